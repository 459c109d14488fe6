"""The disaggregated proxy against stand-in servers (no model): it carries 256 concurrent streams,
times out on a server that hangs, reports both servers' health, and refuses a bad request before
any prefill runs. (test_server.py runs it between two real servers.)"""
import asyncio
import socket
import threading
import time

import httpx
import pytest
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import StreamingResponse

from nanoinfer.entrypoints.disagg_proxy import create_proxy

STREAMS = 256


class Upstream:
    """A stand-in server whose requests wait until `release` of them are in flight at once (or
    forever, with `hang`)."""

    def __init__(self, release: int = 1, hang: bool = False):
        self.seen, self.release, self.hang = [], release, hang
        self.app, self.all_in = FastAPI(), None

        @self.app.post("/v1/completions")
        async def completions(request: Request):
            self.seen.append(await request.json())
            self.all_in = self.all_in or asyncio.Event()
            if len(self.seen) % self.release == 0:
                self.all_in.set()
            # (long enough for 256 streams to arrive on a slow, busy machine; below the proxy's and
            # the client's 60 s, so that a capped pool still fails the test)
            await asyncio.wait_for(self.all_in.wait(), 50)
            if self.hang:
                await asyncio.sleep(3600)
            if self.seen[-1].get("stream"):
                return StreamingResponse(iter([b"data: {}\n\n", b"data: [DONE]\n\n"]),
                                         media_type="text/event-stream")
            return {"choices": [{"text": "x"}]}

        @self.app.get("/health")
        async def health():
            return {}


def serve(app: FastAPI) -> tuple[str, uvicorn.Server]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, port=port, log_level="warning", backlog=4096))
    threading.Thread(target=server.run, daemon=True).start()
    for _ in range(200):
        if server.started:
            return f"http://127.0.0.1:{port}", server
        time.sleep(0.05)
    raise TimeoutError("a stand-in server did not start")


@pytest.fixture
def servers():
    started = []

    def start(app: FastAPI) -> str:
        url, server = serve(app)
        started.append(server)
        return url
    yield start
    for server in started:
        server.should_exit = True


def test_256_concurrent_streams_go_through(servers):
    """The prefill server answers only once all 256 are in flight: a capped pool would stall."""
    prefill, decode = Upstream(release=STREAMS), Upstream()
    proxy = servers(create_proxy(servers(prefill.app), servers(decode.app), timeout=60))

    async def one(client: httpx.AsyncClient, i: int) -> int:
        answer = await client.post(proxy + "/v1/completions",
                                   json={"prompt": f"request {i}", "stream": True})
        return answer.status_code

    async def main() -> list[int]:
        limits = httpx.Limits(max_connections=None)
        async with httpx.AsyncClient(timeout=60, limits=limits) as client:
            return await asyncio.gather(*(one(client, i) for i in range(STREAMS)))
    assert asyncio.run(main()) == [200] * STREAMS
    assert len(prefill.seen) == len(decode.seen) == STREAMS
    assert all(body["max_tokens"] == 1 and "stream" not in body for body in prefill.seen)


def test_a_server_that_hangs_is_a_504(servers):
    proxy = servers(create_proxy(servers(Upstream(hang=True).app), servers(Upstream().app),
                                 timeout=1))
    answer = httpx.post(proxy + "/v1/completions", json={"prompt": "hi"}, timeout=30)
    assert answer.status_code == 504 and "sent nothing for 1" in answer.json()["error"]["message"]


def test_health_reports_both_servers(servers):
    decode = Upstream()
    proxy = servers(create_proxy(servers(Upstream().app), servers(decode.app)))
    answer = httpx.get(proxy + "/health")
    assert answer.status_code == 200 and answer.json() == {"prefill": 200, "decode": 200}
    decode.app.router.routes = [r for r in decode.app.router.routes if r.path != "/health"]
    answer = httpx.get(proxy + "/health")
    assert answer.status_code == 503 and answer.json() == {"prefill": 200, "decode": 404}
    gone = create_proxy("http://127.0.0.1:9", servers(Upstream().app))   # (nothing listens there)
    answer = httpx.get(servers(gone) + "/health")
    assert answer.status_code == 503 and "ConnectError" in answer.json()["prefill"]


@pytest.mark.parametrize("body, param", [({"prompt": "hi", "temperature": "hot"}, "temperature"),
                                          ({"prompt": "hi", "suffix": "!"}, "suffix"),
                                          ({"prompt": "hi", "n": 2, "best_of": 3}, "best_of"),
                                          ({"prompt": "hi", "stream_options": {}}, "stream_options"),
                                          ({"max_tokens": 3}, "prompt"),
                                          ({"messages": "hi"}, "messages"),
                                          ({"messages": [], "n": 2, "best_of": 3}, "best_of"),
                                          ({"messages": [], "tools": [{}]}, "tools")])
def test_a_bad_request_is_refused_before_the_prefill(servers, body, param):
    prefill = Upstream()
    proxy = servers(create_proxy(servers(prefill.app), servers(Upstream().app)))
    path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
    answer = httpx.post(proxy + path, json=body)
    assert answer.status_code == 400 and answer.json()["error"]["param"] == param
    assert prefill.seen == []
