"""Disaggregated prefill and decode: one server prefills each request, another decodes it.

    python -m nanoinfer.serve --model M --port 8100 --kv-transfer-config '{"kv_role": "kv_producer", ...}'
    python -m nanoinfer.serve --model M --port 8200 --kv-transfer-config '{"kv_role": "kv_consumer", ...}'
    python -m nanoinfer.entrypoints.disagg_proxy --prefill http://127.0.0.1:8100 --decode http://127.0.0.1:8200

The two are ordinary servers of the same model with a KV connector between them (kv_transfer/:
a shared folder, or P2pConnector). For each completion or chat request the proxy first sends it
to the prefill server with max_tokens 1, which leaves the prompt's KV blocks with the connector,
then passes the request as it came to the decode server, which loads them, computes only what it
was not given (the prompt's last partial block, at least), and streams its answer, which the
proxy hands back as it comes. A decode server thus never holds up its decodes behind a long
prompt's prefill.
"""
import argparse
import json

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.background import BackgroundTask

from nanoinfer.entrypoints.protocol import error_body


def create_proxy(prefill: str, decode: str) -> FastAPI:
    app = FastAPI(title="nanoinfer disaggregated proxy")
    client = httpx.AsyncClient(timeout=None)

    async def route(request: Request):
        try:
            return await prefill_then_decode(request)
        except httpx.TransportError as e:   # a server is down, or went away
            return JSONResponse(error_body(502, f"a server behind the proxy failed: {e!r}"), 502)

    async def prefill_then_decode(request: Request):
        path, body = request.url.path, await request.body()
        headers = {k: v for k, v in request.headers.items() if k in ("authorization", "content-type")}
        try:
            prefill_body = json.loads(body)
        except ValueError:   # not JSON: the decode server says so
            prefill_body = None
        if isinstance(prefill_body, dict):
            for key in ("stream", "stream_options", "logprobs", "top_logprobs", "stop", "response_format", "min_tokens"):
                prefill_body.pop(key, None)
            prefill_body |= {"max_tokens": 1} | ({"max_completion_tokens": 1} if "messages" in prefill_body else {})
            done = await client.post(prefill + path, json=prefill_body, headers=headers)
            if done.status_code != 200:   # a bad request: the prefill server's answer says why
                return Response(done.content, done.status_code, media_type=done.headers.get("content-type"))
        answer = await client.send(client.build_request("POST", decode + path, content=body, headers=headers),
                                   stream=True)
        return StreamingResponse(answer.aiter_raw(), answer.status_code, media_type=answer.headers.get("content-type"),
                                 background=BackgroundTask(answer.aclose))

    async def forward(request: Request):   # /health, /v1/models, /metrics: the decode server's
        headers = {k: v for k, v in request.headers.items() if k == "authorization"}
        try:
            answer = await client.get(decode + request.url.path, headers=headers)
        except httpx.TransportError as e:
            return JSONResponse(error_body(503, f"the decode server cannot be reached: {e!r}"), 503)
        return Response(answer.content, answer.status_code, media_type=answer.headers.get("content-type"))

    for path in ("/v1/completions", "/v1/chat/completions"):
        app.add_api_route(path, route, methods=["POST"])
    for path in ("/health", "/v1/models", "/metrics"):
        app.add_api_route(path, forward, methods=["GET"])
    return app


def main(argv=None) -> None:
    import uvicorn
    parser = argparse.ArgumentParser(prog="python -m nanoinfer.entrypoints.disagg_proxy",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--prefill", required=True, help="the prefill server's URL (kv_producer)")
    parser.add_argument("--decode", required=True, help="the decode server's URL (kv_consumer)")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    args = parser.parse_args(argv)
    uvicorn.run(create_proxy(args.prefill.rstrip("/"), args.decode.rstrip("/")), host=args.host, port=args.port,
                log_level="warning")


if __name__ == "__main__":
    main()
