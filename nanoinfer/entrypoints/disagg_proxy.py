"""Disaggregated prefill and decode: one server prefills each request, another decodes it.

    python -m nanoinfer.serve --model M --port 8100 --kv-transfer-config PRODUCER
    python -m nanoinfer.serve --model M --port 8200 --kv-transfer-config CONSUMER
    python -m nanoinfer.entrypoints.disagg_proxy \\
        --prefill http://127.0.0.1:8100 --decode http://127.0.0.1:8200

(PRODUCER and CONSUMER: a kv_transfer_config in JSON, with kv_role "kv_producer" and
"kv_consumer": kv_transfer/.)
The two are ordinary servers of the same model with a KV connector between them (kv_transfer/:
a shared folder). For each completion or chat request the proxy first sends it
to the prefill server with max_tokens 1, which leaves the prompt's KV blocks with the connector,
then passes the request as it came to the decode server, which loads them, computes only what it
was not given (the prompt's last partial block, at least), and streams its answer, which the
proxy hands back as it comes. A decode server thus never holds up its decodes behind a long
prompt's prefill.

The proxy checks each request against the same schema as the servers (protocol.py) before the
prefill runs, so a request the decode server would refuse for its fields never costs a prefill;
what only a server can know (the prompt's length in tokens, a schema too large to compile) the
prefill server refuses, with the same message the decode server would give. Its connections to
the servers are not capped (256 concurrent streams is the serve benchmark's load; set
--max-connections to bound them), and a server that sends nothing for --timeout seconds is a 504.
/health is 200 when both servers are healthy, else 503, and says which is not.
"""
import argparse
import asyncio
import json

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.background import BackgroundTask

from nanoinfer.entrypoints.http import add_error_handlers, error_response
from nanoinfer.entrypoints.protocol import ChatCompletionRequest, CompletionRequest, check_fields

NOT_FOR_PREFILL = ("stream", "stream_options", "min_tokens", "echo")   # (it makes one token)


def create_proxy(prefill: str, decode: str, timeout: float = 600,
                 max_connections: int | None = None) -> FastAPI:
    app = FastAPI(title="nanoinfer disaggregated proxy")
    add_error_handlers(app)
    client = httpx.AsyncClient(timeout=httpx.Timeout(timeout, connect=min(timeout, 10)),
                               limits=httpx.Limits(max_connections=max_connections,
                                                   max_keepalive_connections=None))

    async def route(request: Request, fields) -> Response:
        check_fields(fields)   # (a refused field is a 400 before anything runs)
        try:
            return await prefill_then_decode(client, prefill, decode, request)
        except httpx.TimeoutException:
            return error_response(504, f"a server behind the proxy sent nothing for {timeout} s")
        except httpx.TransportError as e:   # a server is down, or went away
            return error_response(502, f"a server behind the proxy failed: {e!r}")

    async def completions(request: Request, fields: CompletionRequest):
        return await route(request, fields)

    async def chat(request: Request, fields: ChatCompletionRequest):
        return await route(request, fields)

    async def health():
        both = await asyncio.gather(*(health_of(client, url, min(timeout, 10))
                                      for url in (prefill, decode)))
        servers = dict(zip(("prefill", "decode"), both))
        return JSONResponse(servers, 200 if set(servers.values()) == {200} else 503)

    async def forward(request: Request):   # /v1/models, /metrics: the decode server's
        headers = {k: v for k, v in request.headers.items() if k == "authorization"}
        try:
            answer = await client.get(decode + request.url.path, headers=headers)
        except httpx.TransportError as e:
            return error_response(503, f"the decode server cannot be reached: {e!r}")
        return Response(answer.content, answer.status_code,
                        media_type=answer.headers.get("content-type"))

    app.add_api_route("/v1/completions", completions, methods=["POST"])
    app.add_api_route("/v1/chat/completions", chat, methods=["POST"])
    app.add_api_route("/health", health, methods=["GET"])
    for path in ("/v1/models", "/metrics"):
        app.add_api_route(path, forward, methods=["GET"])
    return app


async def prefill_then_decode(client: httpx.AsyncClient, prefill: str, decode: str,
                              request: Request) -> Response:
    """The request to the prefill server with max_tokens 1, then as it came to the decode server."""
    path, body = request.url.path, await request.body()
    headers = {k: v for k, v in request.headers.items() if k in ("authorization", "content-type")}
    prefill_body = {k: v for k, v in json.loads(body).items() if k not in NOT_FOR_PREFILL}
    prefill_body |= {"max_tokens": 1} | ({"max_completion_tokens": 1}
                                         if "messages" in prefill_body else {})
    done = await client.post(prefill + path, json=prefill_body, headers=headers)
    if done.status_code != 200:   # a bad request: the prefill server's answer says why
        return Response(done.content, done.status_code, media_type=done.headers.get("content-type"))
    decoding = client.build_request("POST", decode + path, content=body, headers=headers)
    answer = await client.send(decoding, stream=True)
    return StreamingResponse(answer.aiter_raw(), answer.status_code,
                             media_type=answer.headers.get("content-type"),
                             background=BackgroundTask(answer.aclose))


async def health_of(client: httpx.AsyncClient, url: str, timeout: float) -> int | str:
    """A server's /health status, or why it could not be reached."""
    try:
        return (await client.get(url + "/health", timeout=timeout)).status_code
    except httpx.HTTPError as e:
        return repr(e)


def main(argv=None) -> None:
    import uvicorn
    parser = argparse.ArgumentParser(prog="python -m nanoinfer.entrypoints.disagg_proxy",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--prefill", required=True, help="the prefill server's URL (kv_producer)")
    parser.add_argument("--decode", required=True, help="the decode server's URL (kv_consumer)")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--timeout", type=float, default=600,
                        help="seconds a server may send nothing before the request is a 504")
    parser.add_argument("--max-connections", type=int, default=None,
                        help="connections to the servers at most (default: no cap)")
    args = parser.parse_args(argv)
    app = create_proxy(args.prefill.rstrip("/"), args.decode.rstrip("/"), args.timeout,
                       args.max_connections)
    uvicorn.run(app, host=args.host, port=args.port, log_level="warning")


if __name__ == "__main__":
    main()
