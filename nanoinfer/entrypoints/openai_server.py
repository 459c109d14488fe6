"""An OpenAI-compatible HTTP server over AsyncLLM: `python -m nanoinfer.serve --model PATH`.

    POST /v1/completions, /v1/chat/completions   (stream: true -> server-sent events, then [DONE])
    GET  /v1/models, /health, /metrics (Prometheus text)

A request's path: FastAPI parses the JSON body into a request model (a wrong type is a 400);
the handler tokenizes the prompt (a chat through the model's chat template), maps the fields to
SamplingParams (a bad value is a 400 naming it) and iterates `AsyncLLM.generate`; each
RequestOutput becomes a chunk (streaming, DELTA outputs) or the final answer. A client that goes
away mid-stream cancels the handler's task, which aborts the request and frees its blocks.
Errors have OpenAI's body, `{"error": {"message", "type", "param", "code"}}`.
"""
import asyncio
import json
import logging
import uuid

import prometheus_client as prom
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from starlette.exceptions import HTTPException

from nanoinfer.engine.async_llm import AsyncLLM
from nanoinfer.engine.llm_engine import EngineDeadError
from nanoinfer.entrypoints.protocol import (APIError, ChatCompletionRequest, Chunker, CompletionRequest, error_body,
                                            sampling_params)

logger = logging.getLogger("nanoinfer")


class APIKeyMiddleware:
    """Every /v1 route needs "Authorization: Bearer KEY", checked before the body is read. A plain
    ASGI middleware: the app's responses pass through it untouched (Starlette's @app.middleware
    would wrap every chunk of every stream)."""

    def __init__(self, app, api_key: str):
        self.app, self.expected = app, f"Bearer {api_key}".encode()

    async def __call__(self, scope, receive, send):
        path, root = scope.get("path", ""), scope.get("root_path", "")
        if root and path.startswith(root):   # (the route's path: under a mount or --root-path)
            path = path[len(root):]
        if scope["type"] == "http" and path.startswith("/v1") and \
                dict(scope["headers"]).get(b"authorization") != self.expected:
            return await JSONResponse(error_body(401, "missing or wrong API key"), 401)(scope, receive, send)
        await self.app(scope, receive, send)


class EngineCollector:
    """Each engine core's load and prefix cache, read at scrape time (label `engine`: its DP rank)."""

    def __init__(self, engine: AsyncLLM):
        self.engine = engine

    def collect(self):
        families = [GaugeMetricFamily("nanoinfer:num_requests_running", "Sequences running", labels=["engine"]),
                    GaugeMetricFamily("nanoinfer:num_requests_waiting", "Sequences waiting", labels=["engine"]),
                    GaugeMetricFamily("nanoinfer:kv_cache_usage_perc", "KV-cache blocks in use (0-1)", labels=["engine"]),
                    CounterMetricFamily("nanoinfer:prefix_cache_queries", "Prompt tokens looked up", labels=["engine"]),
                    CounterMetricFamily("nanoinfer:prefix_cache_hits", "Prompt tokens found", labels=["engine"]),
                    CounterMetricFamily("nanoinfer:aborted_seqs", "Sequences ended early (abort, stop string)",
                                        labels=["engine"])]
        for rank, s in enumerate(self.engine.stats()):
            values = [s.num_running, s.num_waiting, s.kv_cache_usage, s.prefix_cache_queries, s.prefix_cache_hits,
                      s.num_aborted_seqs]
            for family, value in zip(families, values):
                family.add_metric([str(rank)], value)
        yield from families


def create_app(engine: AsyncLLM, model_name: str, api_key: str | None = None) -> FastAPI:
    app = FastAPI(title="nanoinfer")
    tokenizer, max_model_len = engine.tokenizer, engine.config.max_model_len
    registry = prom.CollectorRegistry()
    registry.register(EngineCollector(engine))
    prompt_tokens = prom.Counter("nanoinfer:prompt_tokens", "Prompt tokens", registry=registry)
    generation_tokens = prom.Counter("nanoinfer:generation_tokens", "Generated tokens", registry=registry)
    ttft = prom.Histogram("nanoinfer:time_to_first_token_seconds", "Time to first token", registry=registry,
                          buckets=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30))
    itl = prom.Histogram("nanoinfer:inter_token_latency_seconds", "Time between tokens", registry=registry,
                         buckets=(0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56))

    if api_key:
        app.add_middleware(APIKeyMiddleware, api_key=api_key)

    def encode(text: str, add_special_tokens: bool = True) -> list[int]:
        if tokenizer is None:
            raise APIError(400, "text needs a tokenizer, and this server was started with --skip-tokenizer-init: "
                                "send a completion's prompt as token ids")
        return tokenizer.encode(text, add_special_tokens=add_special_tokens)

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, e: RequestValidationError):
        first = e.errors()[0]
        if first["type"] == "json_invalid":
            return JSONResponse(error_body(400, f"the body is not valid JSON: {first['ctx']['error']}"), 400)
        where = ".".join(str(part) for part in first["loc"] if part != "body")
        return JSONResponse(error_body(400, f"{where or 'body'}: {first['msg']}", where or None), 400)

    @app.exception_handler(APIError)
    async def api_error(request: Request, e: APIError):
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
    async def metrics():
        return Response(prom.generate_latest(registry), media_type=prom.CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": model_name, "object": "model", "created": 0,
                                            "owned_by": "nanoinfer", "max_model_len": max_model_len}]}

    @app.post("/v1/completions")
    async def completions(request: CompletionRequest, raw: Request):
        if isinstance(request.prompt, str):
            prompt = {"prompt": request.prompt, "prompt_token_ids": encode(request.prompt)}
        else:
            prompt = {"prompt_token_ids": request.prompt}
        return await generate(request, prompt, False, raw)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: ChatCompletionRequest, raw: Request):
        encode("")   # (a 400 without a tokenizer)
        try:
            text = tokenizer.apply_chat_template(request.messages, tokenize=False, add_generation_prompt=True)
        except Exception as e:   # a malformed conversation, or a template that refuses it
            raise APIError(400, f"messages: {e}", "messages") from e
        prompt = {"prompt": text, "prompt_token_ids": encode(text, add_special_tokens=False)}
        return await generate(request, prompt, True, raw)

    async def generate(request, prompt: dict, chat: bool, raw: Request):
        if request.model is not None and request.model != model_name:
            raise APIError(404, f"the model {request.model!r} does not exist (this server has {model_name!r})", "model")
        params = sampling_params(request, len(prompt["prompt_token_ids"]), chat, max_model_len)
        request_id = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        outputs = engine.generate(prompt, params, request_id)
        top_n = (request.top_logprobs or 0) if chat else request.logprobs
        chunk = Chunker(request_id, model_name, chat, len(prompt["prompt_token_ids"]), top_n)

        async def all_outputs():   # the engine's errors as HTTP's; the request's metrics
            out = None
            try:
                async for out in outputs:
                    c = out.outputs[0]
                    if c.finish_reason == "abort" and isinstance(c.stop_reason, str):   # its grammar failed
                        raise APIError(400, c.stop_reason, "response_format")
                    yield out
            except APIError:
                raise
            except ValueError as e:   # (found before the request was queued)
                raise APIError(400, str(e)) from e
            except EngineDeadError as e:
                raise APIError(500, str(e)) from e
            except Exception as e:   # a bug
                logger.exception("request %s failed", request_id)
                raise APIError(500, f"internal error ({type(e).__name__}); see the server's log") from e
            finally:
                await outputs.aclose()   # (left early: the client went away; this aborts it)
                if out is not None:   # it was accepted
                    prompt_tokens.inc(chunk.prompt_tokens)
                    generation_tokens.inc(chunk.completion_tokens)
            m, n = out.metrics, chunk.completion_tokens
            if m.first_token_time is not None:
                ttft.observe(m.first_token_time - m.arrival_time)
            if n > 1:
                itl.observe((m.last_token_time - m.first_token_time) / (n - 1))

        if not request.stream:   # the answer, unless the client goes away first (then: abort)
            async def answer():
                async for out in all_outputs():
                    response = chunk.final(out)
                return response
            response = await until_disconnected(raw, answer())
            return Response(status_code=499) if response is None else response

        stream = all_outputs()
        first = await until_disconnected(raw, stream.__anext__())   # (a bad request is still a 400)
        if first is None:
            return Response(status_code=499)

        async def events():
            try:
                yield f"data: {json.dumps(chunk.delta(first))}\n\n"
                async for out in stream:
                    yield f"data: {json.dumps(chunk.delta(out))}\n\n"
                if (request.stream_options or {}).get("include_usage"):
                    yield f"data: {json.dumps(chunk.usage_chunk())}\n\n"
            except Exception as e:   # (all_outputs' errors are APIErrors: anything else is a bug here)
                if not isinstance(e, APIError):
                    logger.exception("request %s failed", request_id)
                    e = APIError(500, "internal error; see the server's log")
                yield f"data: {json.dumps(error_body(e.status, str(e)))}\n\n"
            finally:
                await stream.aclose()
            yield "data: [DONE]\n\n"
        return StreamingResponse(events(), media_type="text/event-stream")

    return app


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
