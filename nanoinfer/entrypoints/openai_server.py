"""An OpenAI-compatible HTTP server over AsyncLLM: `python -m nanoinfer.serve --model PATH`.

    POST /v1/completions, /v1/chat/completions   (stream: true -> server-sent events, then [DONE])
    GET  /v1/models, /v1/models/{id}, /health, /metrics (Prometheus text, vLLM's names)

A request's path: FastAPI parses the JSON body into a request model (a wrong type is a 400);
the prompt is tokenized (a chat through the model's chat template; a long text in the engine's
input thread, off the event loop, so that it holds up no other stream); the fields become
SamplingParams (a bad value is a 400 naming it) and each prompt (a completion may send a list of
them) runs as a request of `AsyncLLM.generate`. Its RequestOutputs become chunks (streaming,
DELTA outputs) or the final answer: choice `i * n + j` is sample j of prompt i. A client that
goes away cancels the handler's task, which aborts its requests and frees their blocks.
Errors have OpenAI's body, `{"error": {"message", "type", "param", "code"}}`.
"""
import asyncio
import json
import logging
import uuid

from fastapi import FastAPI, Request
from fastapi.responses import Response, StreamingResponse

from nanoinfer.engine.async_llm import LONG_TEXT, AsyncLLM
from nanoinfer.engine.exceptions import EngineDeadError
from nanoinfer.entrypoints.errors import APIError, api_error, error_body
from nanoinfer.entrypoints.http import RequestGuard, add_error_handlers, until_disconnected
from nanoinfer.entrypoints.metrics import ServerMetrics
from nanoinfer.entrypoints.protocol import (ChatCompletionRequest, Chunker, CompletionRequest,
                                            StreamOptions, field_names, sampling_params)

logger = logging.getLogger("nanoinfer")


async def merge(streams):
    """(i, item) from several async iterators, as the items come; an error, or closing it,
    closes them all (a stream whose next item is on its way is closed by cancelling that)."""
    pending = {asyncio.ensure_future(s.__anext__()): i for i, s in enumerate(streams)}
    try:
        while pending:
            done, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            errors = [(task, pending.pop(task), task.exception()) for task in done]
            for task, i, error in errors:
                if error is not None and not isinstance(error, StopAsyncIteration):
                    raise error   # (the first; the others were retrieved above)
            for task, i, error in errors:
                if error is None:
                    pending[asyncio.ensure_future(streams[i].__anext__())] = i
                    yield i, task.result()
    finally:
        for task in pending:
            task.cancel()
        for i in set(range(len(streams))) - set(pending.values()):
            await streams[i].aclose()


class OpenAIServing:
    """What the routes do: a request's prompts tokenized, run, and answered in OpenAI's shapes."""

    def __init__(self, engine: AsyncLLM, model_name: str):
        self.engine = engine
        self.model_name = model_name
        self.metrics = ServerMetrics(engine, model_name)
        engine.stat_logger = self.metrics.record
        self.card = {"id": model_name, "object": "model", "created": 0, "owned_by": "nanoinfer",
                     "max_model_len": engine.config.max_model_len}

    def model(self, model_id: str | None) -> dict:
        if model_id is not None and model_id != self.model_name:
            raise APIError(404, f"the model {model_id!r} does not exist (this server has "
                                f"{self.model_name!r})", "model")
        return self.card

    async def tokenize(self, where: str, num_chars: int, fn, *args):
        """fn(*args), off the event loop for a long text (ValueError, such as text without a
        tokenizer: a 400). The body limit (--max-request-bytes) bounds the text."""
        try:
            return await self.engine.off_loop(num_chars > LONG_TEXT, fn, *args)
        except ValueError as e:
            raise APIError(400, str(e), where) from e

    async def completion_prompts(self, request: CompletionRequest) -> list[dict]:
        """A string, token ids, or a list of either."""
        prompts = request.prompt
        if not isinstance(prompts, list) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        if not prompts:
            raise APIError(400, "prompt is an empty list", "prompt")
        encode = self.engine.input_processor.encode
        inputs = []
        for prompt in prompts:   # (text is tokenized; token ids pass through)
            if isinstance(prompt, list):
                inputs.append({"prompt_token_ids": prompt})
            else:
                token_ids = await self.tokenize("prompt", len(prompt), encode, prompt)
                inputs.append({"prompt": prompt, "prompt_token_ids": token_ids})
        return inputs

    async def chat_prompt(self, request: ChatCompletionRequest) -> list[dict]:
        num_chars = sum(len(str(m.get("content"))) for m in request.messages)
        return [await self.tokenize("messages", num_chars, self.engine.input_processor.chat_prompt,
                                    request.messages)]

    async def generate(self, request, prompts: list[dict], chat: bool, raw: Request):
        """Each prompt a request of the engine's; the answer, or a stream of chunks."""
        self.model(request.model)
        lens = [len(p["prompt_token_ids"]) for p in prompts]
        params = sampling_params(request, lens, chat, self.engine.config.max_model_len)
        request_id = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        top_n = (request.top_logprobs or 0) if chat else request.logprobs
        options = request.stream_options or StreamOptions()
        usage = bool(options.include_usage)
        chunker = Chunker(request_id, self.model_name, chat, params.n, prompts, top_n,
                          not chat and request.echo, self.engine.tokenizer,
                          continuous_usage=usage and bool(options.continuous_usage_stats))
        streams = [self.engine.generate(prompt, params, f"{request_id}-{i}")
                   for i, prompt in enumerate(prompts)]
        outputs = engine_errors(merge(streams), field_names(request, chat), request_id)
        # The answer, or the stream, unless the client goes away first (a 499; this aborts them)
        if not request.stream:
            async def answer():
                finals = {i: out async for i, out in outputs}   # (prompt i: its final output)
                return chunker.final([finals[i] for i in range(len(prompts))])
            return await until_disconnected(raw, answer())
        first = await until_disconnected(raw, outputs.__anext__())   # (a bad request: still a 400)
        return StreamingResponse(events(first, outputs, chunker, usage, request_id),
                                 media_type="text/event-stream")


async def events(first, outputs, chunker: Chunker, usage: bool, request_id: str):
    """A stream's server-sent events: a chunk per choice an output brings, then [DONE]."""
    def event(body: dict) -> str:
        return f"data: {json.dumps(body)}\n\n"
    try:
        for chunk in chunker.deltas(*first):
            yield event(chunk)
        async for i, out in outputs:
            for chunk in chunker.deltas(i, out):
                yield event(chunk)
        if usage:
            yield event(chunker.usage_chunk())
    except Exception as e:   # (engine_errors' are APIErrors: anything else is a bug here)
        if not isinstance(e, APIError):
            logger.exception("request %s failed", request_id)
            e = APIError(500, "internal error; see the server's log")
        yield event(error_body(e.status, str(e)))
    finally:
        await outputs.aclose()
    yield "data: [DONE]\n\n"


def create_app(engine: AsyncLLM, model_name: str, api_key: str | None = None,
               max_request_bytes: int | None = None) -> FastAPI:
    app = FastAPI(title="nanoinfer")
    app.add_middleware(RequestGuard, api_key=api_key, max_request_bytes=max_request_bytes)
    serving = OpenAIServing(engine, model_name)
    add_error_handlers(app)

    @app.get("/health")
    async def health():
        return Response(status_code=503 if len(engine.errors) == len(engine.client.conns) else 200)

    @app.get("/metrics")
    async def prometheus():
        return Response(serving.metrics.exposition(), media_type="text/plain; version=0.0.4")

    @app.get("/engine/events")
    async def engine_events(core: int = 0):
        """Core `core`'s event log, live, for the view (python -m view --live URL)."""
        if not 0 <= core < len(engine.client.conns) or core in engine.errors:
            raise APIError(404, f"there is no live engine core {core}", "core")
        if core in engine.viewers:
            raise APIError(409, f"engine core {core} has a viewer already (python -m view "
                                "--live URL shows one stream to any number of pages)", "core")
        return StreamingResponse(engine.watch(core), media_type="text/event-stream")

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [serving.card]}

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str):
        return serving.model(model_id)

    @app.post("/v1/completions")
    async def completions(request: CompletionRequest, raw: Request):
        prompts = await serving.completion_prompts(request)
        return await serving.generate(request, prompts, False, raw)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: ChatCompletionRequest, raw: Request):
        return await serving.generate(request, await serving.chat_prompt(request), True, raw)

    return app


async def engine_errors(outputs, names: dict[str, str], request_id: str):
    """The outputs, the engine's errors as HTTP's; closing it closes (aborts) the requests."""
    try:
        async for i, out in outputs:
            for c in out.outputs:
                # an abort with a message: its grammar failed
                if c.finish_reason == "abort" and isinstance(c.stop_reason, str):
                    raise APIError(400, c.stop_reason, names["guided_decoding"])
            yield i, out
    except APIError:
        raise
    except ValueError as e:   # (found before the request was queued)
        raise api_error(e, names) from e
    except EngineDeadError as e:
        raise APIError(500, str(e)) from e
    except Exception as e:   # a bug
        logger.exception("request %s failed", request_id)
        raise APIError(500, f"internal error ({type(e).__name__}); see the server's log") from e
    finally:
        await outputs.aclose()   # (left early: the client went away; this aborts them)
