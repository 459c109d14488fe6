"""AsyncLLM: the engine for a server, streaming each request's outputs to an asyncio caller.

    async for out in engine.generate(prompt, params, request_id):   # a RequestOutput per step
        ...

The front end runs in the caller's event loop: it tokenizes and validates the request
(InputProcessor; a bad one raises ValueError at once; a long text or a grammar to build in a
thread of its own, `off_loop`, so that it holds up no stream), sends it to an engine core process
(core_client.py), and gives the request a stream. The client's reader thread hands each step's
token ids to the event loop, where the OutputProcessor detokenizes them and puts each request's
RequestOutput in its stream (all front-end state is touched in the loop's thread only). A stop
string found here ends the sequence in the core too.

A consumer that falls behind the engine (many streams, one event loop) does not fall further
behind: the DELTA outputs that pile up in its stream are merged into one, so it gets fewer,
larger outputs, and its work per step stays bounded.

A request ends with a finished output, or an exception: EngineDeadError when its core died.
Leaving the `async for` early (the client disconnected: the task is cancelled) aborts the
request, which frees its blocks in the core at once.
"""
import asyncio
import json
import logging
import weakref
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor

from nanoinfer.config import Config
from nanoinfer.engine.core_client import EngineCoreClient
from nanoinfer.engine.exceptions import EngineDeadError
from nanoinfer.engine.front_end import FrontEnd
from nanoinfer.engine.input_processor import PromptType
from nanoinfer.engine.output_processor import IterationStats
from nanoinfer.outputs import RequestOutput
from nanoinfer.sampling_params import RequestOutputKind, SamplingParams

logger = logging.getLogger("nanoinfer")
# A text of more characters than this is tokenized off the event loop.
LONG_TEXT = 20_000
# A live viewer this many records behind is let go (it connects again, for a new snapshot).
VIEWER_BACKLOG = 50_000


class RequestStream:
    """One request's outputs on their way to its consumer: at most one waits, later DELTA outputs
    merge into it (any other kind's newest replaces it); an exception ends the stream."""

    def __init__(self, output_kind: RequestOutputKind):
        self.merge = output_kind == RequestOutputKind.DELTA
        self.output: RequestOutput | BaseException | None = None
        self.ready = asyncio.Event()

    def put(self, out: RequestOutput | BaseException) -> None:
        if self.merge and isinstance(self.output, RequestOutput) and isinstance(out, RequestOutput):
            self.output.add(out)
        elif not isinstance(self.output, BaseException):
            self.output = out
        self.ready.set()

    async def get(self) -> RequestOutput:
        await self.ready.wait()
        self.ready.clear()
        out = self.output
        self.output = None
        if isinstance(out, BaseException):
            raise out
        return out


def fresh(error: BaseException) -> BaseException:
    """A new exception for one request: the engine's death as itself, a front-end bug as a
    RuntimeError caused by it (never its own type: a ValueError there is not the caller's fault)."""
    if isinstance(error, EngineDeadError):
        return EngineDeadError(str(error))
    new = RuntimeError(f"the front end failed ({type(error).__name__}: {error})")
    new.__cause__ = error
    return new


def is_heavy(prompt: PromptType, params) -> bool:
    """Is a request's input slow to process: a grammar to build, or a long text to tokenize?"""
    if getattr(params, "guided_decoding", None) is not None:
        return True
    if isinstance(prompt, dict):
        prompt = None if "prompt_token_ids" in prompt else prompt.get("prompt")
    return isinstance(prompt, str) and len(prompt) > LONG_TEXT


class AsyncLLM(FrontEnd):

    def __init__(self, model: str, data_parallel_size: int = 1,
                 data_parallel_size_local: int | None = None,
                 data_parallel_address: tuple[str, int] | None = None, **kwargs):
        # The tokenizer, the input processor and the output processor.
        super().__init__(Config(model, **kwargs))
        self.streams: dict[str, RequestStream] = {}
        # The caller's event loop, from its first request on.
        self.loop: asyncio.AbstractEventLoop | None = None
        # The cores that died, and why.
        self.errors: dict[int, EngineDeadError] = {}
        self.inputs = ThreadPoolExecutor(1, thread_name_prefix="nanoinfer-inputs")
        # a server's metrics: stat_logger(core rank, IterationStats), after each step's outputs,
        # and for each aborted request (finished alone)
        self.stat_logger: Callable | None = None
        # each core's live viewer of its event log (the view's own server: `watch`)
        self.viewers: dict[int, asyncio.Queue] = {}
        self.client = EngineCoreClient(self.config, self.on_message, data_parallel_size,
                                       data_parallel_size_local, data_parallel_address)
        weakref.finalize(self, self.client.shutdown)

    async def generate(self, prompt: PromptType, params: SamplingParams | None,
                       request_id: str) -> AsyncIterator[RequestOutput]:
        """Stream a request's outputs (as `params.output_kind` says); the last one is finished."""
        self.loop = asyncio.get_running_loop()
        if len(self.errors) == len(self.client.conns):
            raise fresh(next(iter(self.errors.values())))
        text, request = await self.off_loop(is_heavy(prompt, params), self.input_processor.process,
                                            request_id, prompt, params)
        self.output_processor.add_request(text, request)   # (ValueError if the id is in use)
        stream = self.streams[request_id] = RequestStream(request.params[0].output_kind)
        try:
            self.client.add_request(request)
            while not (out := await stream.get()).finished:
                yield out
            yield out
        # Finished, failed, or left early (cancelled): nothing of it stays behind, unless the id
        # is already a new request's.
        finally:
            if self.streams.get(request_id) is stream:
                self.forget(request_id)

    async def off_loop(self, heavy: bool, fn, *args):
        """fn(*args): in the input thread if it is heavy (a long text to tokenize, a grammar to
        build), else right here: handing work to a thread costs up to Python's switch interval
        (5 ms) while the event loop is busy, which hundreds of requests at once would queue."""
        if not heavy:
            return fn(*args)
        return await asyncio.get_running_loop().run_in_executor(self.inputs, fn, *args)

    def abort(self, request_id: str) -> None:
        """Stop a request and free its blocks; its stream ends with an output whose unfinished
        samples end with "abort". An id no longer live is ignored."""
        if request_id in self.streams and request_id in self.output_processor.requests:
            self.streams[request_id].put(self.output_processor.aborted_output(request_id))
        self.forget(request_id)

    def abort_all(self) -> None:
        """Abort every request still streaming, and end the viewers' streams (a server's shutdown
        timeout has passed)."""
        for request_id in list(self.streams):
            self.abort(request_id)
        for rank in list(self.viewers):
            self.stop_watching(rank)

    async def watch(self, rank: int) -> AsyncIterator[str]:
        """Core `rank`'s event log as it is made, as server-sent events: a header and a snapshot,
        then every record (engine/event_log.py), and a comment every 15 s of quiet (an idle
        engine's viewer stays). One viewer a core: the view's own server shows it to any number
        of pages."""
        self.loop = asyncio.get_running_loop()
        records = self.viewers[rank] = asyncio.Queue()
        self.client.send(rank, ("view", True))
        try:
            while True:
                try:
                    if (record := await asyncio.wait_for(records.get(), 15)) is None:
                        return
                    yield f"data: {record}\n\n"
                except asyncio.TimeoutError:
                    yield ": still here\n\n"
        finally:
            if self.viewers.get(rank) is records:
                self.stop_watching(rank)

    def stop_watching(self, rank: int) -> None:
        if (viewer := self.viewers.pop(rank, None)) is not None:
            viewer.put_nowait(None)
            self.client.send(rank, ("view", False))

    def forget(self, request_id: str) -> None:
        self.streams.pop(request_id, None)
        if request_id in self.output_processor.requests:
            state = self.output_processor.requests[request_id]
            self.client.abort(request_id, self.output_processor.remove_request(request_id))
            if self.stat_logger is not None:
                rank = self.client.owner.get(request_id, 0)
                self.stat_logger(rank, IterationStats(finished=[state]))
        self.client.finished(request_id)

    def on_message(self, rank: int, message: tuple) -> None:
        """From the client's reader thread: go on in the event loop's."""
        # A core's death is noted once (its traceback is in the server's log).
        if message[0] == "dead" and rank not in self.errors:
            lines = message[1].strip().splitlines()
            reason = lines[-1] if lines else "no reason given"
            self.errors[rank] = EngineDeadError(f"engine core {rank} died ({reason})")
        try:
            if self.loop is not None:
                self.loop.call_soon_threadsafe(self.process, rank, message)
        # The loop is closed: no request of it is left.
        except RuntimeError:
            pass

    def process(self, rank: int, message: tuple) -> None:
        # Every request of a core that died fails.
        if message[0] == "dead":
            self.stop_watching(rank)
            held = [r for r, owner in self.client.owner.items() if owner == rank]
            self.fail(held, self.errors[rank])
            return
        viewer = self.viewers.get(rank)
        if viewer is not None and viewer.qsize() >= VIEWER_BACKLOG:   # (it does not read: let go)
            self.stop_watching(rank)
        elif viewer is not None:   # (each record encoded once, here, off the core's step loop)
            for record in message[3]:
                viewer.put_nowait(json.dumps(record))
        seqs = self.output_processor.seqs
        touched = {seqs[o.seq_id][0].request_id for o in message[1] if o.seq_id in seqs}
        try:
            stats = None if self.stat_logger is None else IterationStats()
            try:
                outputs, stopped = self.output_processor.process_outputs(message[1], stats)
            # (what the step did is counted even if building its outputs failed)
            finally:
                if stats is not None:
                    self.stat_logger(rank, stats)
            # A sequence that a stop string ended goes on in the core, which has not seen that.
            for seq_id, _ in stopped:
                self.client.send(rank, ("stop", [seq_id]))
            for out in outputs:
                if out.request_id in self.streams:
                    self.streams[out.request_id].put(out)
                if out.finished:
                    self.client.finished(out.request_id)
        # A bug here must not leave the step's requests waiting forever.
        except Exception as e:
            logger.exception("processing engine core %d's outputs failed", rank)
            self.fail(touched, e)

    def fail(self, request_ids, error: BaseException) -> None:
        for request_id in list(request_ids):
            if request_id in self.streams:
                # An error of its own: tracebacks must not grow from request to request.
                self.streams[request_id].put(fresh(error))
            self.forget(request_id)

    def shutdown(self) -> None:
        """Stop the core processes; requests still live get EngineDeadError."""
        self.client.shutdown()
        self.inputs.shutdown(wait=False, cancel_futures=True)
        for rank in range(len(self.client.conns)):
            self.on_message(rank, ("dead", "the engine was shut down"))
