"""The offline engine: a front end (tokenize, validate, detokenize) over an engine core in this
process, one step at a time.

`step()` runs one step of the core (engine/core.py: schedule, run the model, sample, apply
the token stops) and turns the token ids it returns into each touched request's output
(output_processor.py: detokenize, stop strings). Requests come in through `add_request`
(input_processor.py validates them first).

The API is vLLM's and serves both the offline `LLM` and a loop of one's own: `add_request` and
`abort_request` may be called between steps. A request is validated in `add_request`, so a bad
one is rejected with a clear error before it is queued and never disturbs the others; no
request-level error can arise inside a step. An exception inside a step (a bug, the GPU failing)
leaves the engine dead: the step's requests and every other one are lost, and every later call
raises `EngineDeadError` saying why, instead of running on from a state nobody can vouch for.
Ctrl-C (KeyboardInterrupt) inside a step aborts every request and keeps the engine usable; with
tensor parallelism it may have cut a message to the workers in half, so it stops them instead.
"""
from collections.abc import Iterable

from nanoinfer.config import Config
from nanoinfer.engine.core import EngineCore
from nanoinfer.engine.exceptions import EngineDeadError
from nanoinfer.engine.front_end import FrontEnd
from nanoinfer.engine.input_processor import PromptType
from nanoinfer.outputs import RequestOutput
from nanoinfer.sampling_params import SamplingParams


# the engine's error while a step runs: still there afterwards if the step (or its Ctrl-C handler)
# was itself cut off, which leaves the engine's state unknown
STEP_CUT_OFF = EngineDeadError("a step was cut off half-way (Ctrl-C twice?): its state is unknown")


class LLMEngine(FrontEnd):

    def __init__(self, config: Config):
        # The tokenizer, the input processor and the output processor.
        super().__init__(config)
        self.engine_core = EngineCore(config, self.tokenizer)
        # The core's parts, for tests and bench.py's timers.
        self.scheduler = self.engine_core.scheduler
        self.model_executor = self.engine_core.model_executor
        self.structured_output = self.engine_core.structured_output
        # What killed the engine, if anything did.
        self.error: BaseException | None = None

    def add_request(self, request_id: str, prompt: PromptType,
                    params: SamplingParams | None = None) -> None:
        """Validate and queue a request; raises ValueError saying what is wrong with it."""
        self.check_alive()
        text, request = self.input_processor.process(request_id, prompt, params)
        self.output_processor.add_request(text, request)
        self.engine_core.add_request(request)

    def abort_request(self, request_ids: str | Iterable[str]) -> None:
        """Stop requests at once and free their blocks; ids no longer live are ignored."""
        if self.error is not None:
            return   # (a dead engine holds no requests)
        for request_id in [request_ids] if isinstance(request_ids, str) else request_ids:
            if request_id in self.output_processor.requests:
                self.engine_core.abort_requests(self.output_processor.remove_request(request_id))

    def has_unfinished_requests(self) -> bool:
        self.check_alive()
        return self.engine_core.has_unfinished()

    def check_alive(self) -> None:
        if isinstance(self.error, EngineDeadError):
            raise EngineDeadError(str(self.error))
        if self.error is not None:
            raise EngineDeadError(
                f"the engine stopped after an error in a step ({type(self.error).__name__}: "
                f"{self.error}); its requests are lost: create a new engine") from self.error

    def step(self) -> list[RequestOutput]:
        self.check_alive()
        # Until the step, or its handler below, is through.
        self.error = STEP_CUT_OFF
        try:
            outputs, stopped = self.output_processor.process_outputs(self.engine_core.step())
            # the sequences a stop string ended: the core has not seen that
            self.engine_core.abort_requests([seq_id for seq_id, _ in stopped], "stop")
        except BaseException as e:
            # Ctrl-C drops every request and keeps the engine, unless it has worker processes (a
            # message to them may be cut in half: they are stopped). Anything else kills it.
            if isinstance(e, KeyboardInterrupt) and self.config.world_size == 1:
                self.error = None
                self.abort_all()
            else:
                self.error = e
                self.shutdown(graceful=False)
            raise
        self.error = None
        return outputs

    def shutdown(self, graceful: bool = True) -> None:
        """Stop the tensor-parallel workers and free the model and its KV cache; the engine cannot
        be used afterwards. Idempotent."""
        self.engine_core.shutdown(graceful)
        self.model_executor = None
        self.error = self.error or EngineDeadError("the engine was shut down")

    def abort_all(self) -> None:
        """Abort every request (and empty the prefix cache: see EngineCore.abort_all)."""
        self.abort_request(list(self.output_processor.requests))
        self.engine_core.abort_all()

