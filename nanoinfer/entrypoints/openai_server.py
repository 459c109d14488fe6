"""An OpenAI-compatible HTTP server over AsyncLLM: `python -m nanoinfer.serve --model PATH`.

    POST /v1/completions, /v1/chat/completions   (stream: true -> server-sent events, then [DONE])
    GET  /v1/models, /v1/models/{id}, /health, /metrics (Prometheus text, vLLM's names)

A request's path: FastAPI parses the JSON body into a request model (a wrong type is a 400);
the prompt is tokenized (a chat through the model's chat template) in the engine's input thread,
off the event loop, so that a large prompt holds up no other stream; the fields become
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
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException

from nanoinfer.engine.async_llm import AsyncLLM
from nanoinfer.engine.llm_engine import EngineDeadError
from nanoinfer.entrypoints.metrics import ServerMetrics
from nanoinfer.entrypoints.protocol import (APIError, ChatCompletionRequest, Chunker, CompletionRequest,
                                            api_error, error_body, field_names, sampling_params)

logger = logging.getLogger("nanoinfer")


class RequestGuard:
    """Checked before the body is read: every /v1 route needs "Authorization: Bearer KEY", and a
    body may not pass `max_request_bytes` (a 413). A plain ASGI middleware: the app's responses
    pass through it untouched (Starlette's @app.middleware would wrap every chunk of every
    stream). A body sent in chunks without a length that passes the limit is cut off."""

    def __init__(self, app, api_key: str | None, max_request_bytes: int | None):
        self.app, self.max_bytes = app, max_request_bytes
        self.expected = None if api_key is None else f"Bearer {api_key}".encode()

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path, root, headers = scope.get("path", ""), scope.get("root_path", ""), dict(scope["headers"])
        if root and path.startswith(root):   # (the route's path: under a mount or --root-path)
            path = path[len(root):]
        status = 0
        if self.expected and path.startswith("/v1") and headers.get(b"authorization") != self.expected:
            status, message = 401, "missing or wrong API key"
        elif self.max_bytes and int(headers.get(b"content-length", b"0") or 0) > self.max_bytes:
            status, message = 413, f"the request body is larger than {self.max_bytes:,} bytes"
        if status:
            return await JSONResponse(error_body(status, message), status)(scope, receive, send)
        received = 0

        async def limited():
            nonlocal received
            message = await receive()
            received += len(message.get("body", b""))
            return {"type": "http.disconnect"} if self.max_bytes and received > self.max_bytes else message
        await self.app(scope, limited, send)


async def merge(streams):
    """(i, item) from several async iterators, as the items come; closing it closes them all."""
    pending = {asyncio.ensure_future(s.__anext__()): i for i, s in enumerate(streams)}
    try:
        while pending:
            done, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                i = pending.pop(task)
                if isinstance(task.exception(), StopAsyncIteration):
                    continue
                item = task.result()   # (an error ends them all)
                pending[asyncio.ensure_future(streams[i].__anext__())] = i
                yield i, item
    finally:
        for task in pending:
            task.cancel()
        for stream in streams:
            await stream.aclose()


def create_app(engine: AsyncLLM, model_name: str, api_key: str | None = None,
               max_request_bytes: int | None = None) -> FastAPI:
    app = FastAPI(title="nanoinfer")
    app.add_middleware(RequestGuard, api_key=api_key, max_request_bytes=max_request_bytes)
    tokenizer, max_model_len = engine.tokenizer, engine.config.max_model_len
    metrics = ServerMetrics(engine, model_name)
    engine.stat_logger = metrics.record
    # a prompt of more characters than this cannot fit max_model_len: refused before tokenizing
    max_chars = max_model_len * max(map(len, tokenizer.get_vocab()), default=1) if tokenizer else None
    card = {"id": model_name, "object": "model", "created": 0, "owned_by": "nanoinfer",
            "max_model_len": max_model_len}

    async def in_thread(where: str, fn, *args):   # the engine's input thread, off the event loop
        if tokenizer is None:
            raise APIError(400, "text needs a tokenizer, and this server was started with "
                                "--skip-tokenizer-init: send a completion's prompt as token ids", where)
        try:
            return await asyncio.get_running_loop().run_in_executor(engine.inputs, fn, *args)
        except ValueError as e:
            raise APIError(400, str(e), where) from e

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, e: RequestValidationError):
        first = e.errors()[0]
        if first["type"] == "json_invalid":
            return JSONResponse(error_body(400, f"the body is not valid JSON: {first['ctx']['error']}"), 400)
        where = ".".join(str(part) for part in first["loc"] if part != "body")
        param = first["loc"][1] if len(first["loc"]) > 1 else None
        return JSONResponse(error_body(400, f"{where or 'body'}: {first['msg']}", param), 400)

    @app.exception_handler(APIError)
    async def api_error_handler(request: Request, e: APIError):
        return JSONResponse(error_body(e.status, str(e), e.param), e.status)

    @app.exception_handler(HTTPException)   # an unknown route or method
    async def http_error(request: Request, e: HTTPException):
        return JSONResponse(error_body(e.status_code, str(e.detail)), e.status_code, headers=e.headers)

    @app.exception_handler(Exception)   # a bug: still OpenAI's body (the traceback goes to the log)
    async def internal_error(request: Request, e: Exception):
        return JSONResponse(error_body(500, f"internal error ({type(e).__name__}); see the server's log"), 500)

    @app.get("/health")
    async def health():
        return Response(status_code=503 if len(engine.errors) == len(engine.client.conns) else 200)

    @app.get("/metrics")
    async def prometheus():
        return Response(metrics.exposition(), media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [card]}

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str):
        if model_id != model_name:
            raise APIError(404, f"the model {model_id!r} does not exist (this server has {model_name!r})",
                           "model")
        return card

    @app.post("/v1/completions")
    async def completions(request: CompletionRequest, raw: Request):
        prompts = request.prompt if isinstance(request.prompt, list) and request.prompt and \
            not isinstance(request.prompt[0], int) else [request.prompt]
        if not prompts:
            raise APIError(400, "prompt is an empty list", "prompt")
        inputs = []
        for prompt in prompts:
            if isinstance(prompt, list):
                inputs.append({"prompt_token_ids": prompt})
                continue
            if max_chars is not None and len(prompt) > max_chars:
                raise APIError(400, f"the prompt has {len(prompt):,} characters: more tokens than this "
                                    f"model's maximum context length, {max_model_len}", "prompt")
            inputs.append({"prompt": prompt,
                           "prompt_token_ids": await in_thread("prompt", engine.input_processor.encode, prompt)})
        return await generate(request, inputs, False, raw)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: ChatCompletionRequest, raw: Request):
        if max_chars is not None and sum(len(str(m.get("content"))) for m in request.messages) > max_chars:
            raise APIError(400, "the messages are longer than this model's maximum context length, "
                                f"{max_model_len} tokens", "messages")
        prompt = await in_thread("messages", engine.input_processor.chat_prompt, request.messages)
        return await generate(request, [prompt], True, raw)

    async def generate(request, prompts: list[dict], chat: bool, raw: Request):
        if request.model is not None and request.model != model_name:
            raise APIError(404, f"the model {request.model!r} does not exist (this server has "
                                f"{model_name!r})", "model")
        params = sampling_params(request, [len(p["prompt_token_ids"]) for p in prompts], chat, max_model_len)
        request_id = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        top_n = (request.top_logprobs or 0) if chat else request.logprobs
        chunker = Chunker(request_id, model_name, chat, params.n, prompts, top_n,
                          not chat and request.echo, tokenizer)
        outputs = engine_errors(merge([engine.generate(p, params, f"{request_id}-{i}")
                                       for i, p in enumerate(prompts)]), field_names(request, chat), request_id)
        if not request.stream:   # the answer, unless the client goes away first (then: abort)
            async def answer():
                finals = [None] * len(prompts)
                async for i, out in outputs:
                    finals[i] = out
                return chunker.final(finals)
            response = await until_disconnected(raw, answer())
            return Response(status_code=499) if response is None else response
        first = await until_disconnected(raw, outputs.__anext__())   # (a bad request is still a 400)
        if first is None:
            return Response(status_code=499)

        async def events():
            try:
                for chunk in chunker.deltas(*first):
                    yield f"data: {json.dumps(chunk)}\n\n"
                async for i, out in outputs:
                    for chunk in chunker.deltas(i, out):
                        yield f"data: {json.dumps(chunk)}\n\n"
                if (request.stream_options or {}).get("include_usage"):
                    yield f"data: {json.dumps(chunker.usage_chunk())}\n\n"
            except Exception as e:   # (engine_errors' errors are APIErrors: anything else is a bug here)
                if not isinstance(e, APIError):
                    logger.exception("request %s failed", request_id)
                    e = APIError(500, "internal error; see the server's log")
                yield f"data: {json.dumps(error_body(e.status, str(e)))}\n\n"
            finally:
                await outputs.aclose()
            yield "data: [DONE]\n\n"
        return StreamingResponse(events(), media_type="text/event-stream")

    return app


async def engine_errors(outputs, names: dict[str, str], request_id: str):
    """The outputs, the engine's errors as HTTP's; closing it closes (aborts) the requests."""
    try:
        async for i, out in outputs:
            for c in out.outputs:
                if c.finish_reason == "abort" and isinstance(c.stop_reason, str):   # its grammar failed
                    raise APIError(400, c.stop_reason, "response_format")
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


async def disconnected(raw: Request) -> None:
    """Return once the client has gone away (the body was read: the next message says so)."""
    while (await raw.receive())["type"] != "http.disconnect":
        pass


async def until_disconnected(raw: Request, awaitable):
    """The awaitable's result; or None, and the awaitable cancelled, if the client goes away first."""
    task, gone = asyncio.ensure_future(awaitable), asyncio.ensure_future(disconnected(raw))
    try:
        await asyncio.wait((task, gone), return_when=asyncio.FIRST_COMPLETED)
    finally:   # (also when this handler is itself cancelled)
        gone.cancel()
        if not task.done():
            task.cancel()   # (this closes the request's stream: it is aborted)
    return task.result() if task.done() and not task.cancelled() else None
