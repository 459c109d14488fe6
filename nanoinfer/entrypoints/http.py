"""HTTP plumbing below the routes: the guard that checks a request before its body is read,
and waiting for a client that may go away.

`RequestGuard` is a plain ASGI middleware: every /v1 route needs "Authorization: Bearer KEY",
and a body may not pass `max_request_bytes` (a 413, from its Content-Length; a body sent in
chunks without one is counted as it comes). The app's responses pass through it untouched
(Starlette's @app.middleware would wrap every chunk of every stream).

`add_error_handlers(app)`: every error, a bad body's included, in OpenAI's error body (one
such response: `error_response`).

`until_disconnected(raw, awaitable)`: a plain (non-streaming) request waits for its answer and
for its client's disconnect at once; the first to come decides, and a client that left cancels
the awaitable (which aborts its requests) and gets a 499.
"""
import asyncio

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException

from nanoinfer.entrypoints.errors import APIError, error_body


class RequestGuard:
    """Checked before the body is read: every /v1 route needs "Authorization: Bearer KEY", and a
    body may not pass `max_request_bytes` (a 413). A plain ASGI middleware: the app's responses
    pass through it untouched (Starlette's @app.middleware would wrap every chunk of every
    stream). A body sent in chunks without a length that passes the limit is cut off."""

    def __init__(self, app, api_key: str | None, max_request_bytes: int | None):
        self.app = app
        self.max_bytes = max_request_bytes
        self.expected = None if api_key is None else f"Bearer {api_key}".encode()

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = dict(scope["headers"])
        key = headers.get(b"authorization")
        path = scope["path"].removeprefix(scope.get("root_path", ""))   # (the route's, mounted)
        if self.expected and path.startswith(("/v1", "/engine")) and key != self.expected:
            return await error_response(401, "missing or wrong API key")(scope, receive, send)
        if self.max_bytes and int(headers.get(b"content-length", b"0") or 0) > self.max_bytes:
            return await self.too_large()(scope, receive, send)
        received = 0
        refused = False

        async def limited():   # a body without a length: counted as it comes
            nonlocal received, refused
            message = await receive()
            received += len(message.get("body", b""))
            if self.max_bytes and received > self.max_bytes and not refused:
                refused = True   # the 413 is ours; for the app, the client is gone
                await self.too_large()(scope, receive, send)
            return {"type": "http.disconnect"} if refused else message

        async def sent(message):
            if not refused:
                await send(message)
        await self.app(scope, limited, sent)

    def too_large(self) -> JSONResponse:
        return error_response(413, f"the request body is larger than {self.max_bytes:,} bytes")


async def disconnected(raw: Request) -> None:
    """Return once the client has gone away (the body was read: the next message says so)."""
    while (await raw.receive())["type"] != "http.disconnect":
        pass


async def until_disconnected(raw: Request, awaitable):
    """The awaitable's result; or, if the client goes away first, the awaitable cancelled and
    APIError(499) raised (nginx's "client closed request": an answer no one reads)."""
    task, gone = asyncio.ensure_future(awaitable), asyncio.ensure_future(disconnected(raw))
    try:
        await asyncio.wait((task, gone), return_when=asyncio.FIRST_COMPLETED)
    finally:   # (also when this handler is itself cancelled)
        gone.cancel()
        if not task.done():
            task.cancel()   # (this closes the request's stream: it is aborted)
    if not task.done() or task.cancelled():
        raise APIError(499, "the client closed the request")
    return task.result()


def error_response(status: int, message: str, param: str | None = None, **kwargs) -> JSONResponse:
    """An error, in OpenAI's body, as a response (an ASGI app too: `await it(scope, ...)`)."""
    return JSONResponse(error_body(status, message, param), status, **kwargs)


def add_error_handlers(app: FastAPI) -> None:
    """Every error in OpenAI's body."""
    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, e: RequestValidationError):
        first = e.errors()[0]
        if first["type"] == "json_invalid":
            return error_response(400, f"the body is not valid JSON: {first['ctx']['error']}")
        where = ".".join(str(part) for part in first["loc"] if part != "body")
        param = first["loc"][1] if len(first["loc"]) > 1 else None
        return error_response(400, f"{where or 'body'}: {first['msg']}", param)

    @app.exception_handler(APIError)
    async def api_error_handler(request: Request, e: APIError):
        return error_response(e.status, str(e), e.param)

    @app.exception_handler(HTTPException)   # an unknown route or method
    async def http_error(request: Request, e: HTTPException):
        return error_response(e.status_code, str(e.detail), headers=e.headers)

    @app.exception_handler(Exception)   # a bug: still OpenAI's body (the traceback goes to the log)
    async def internal_error(request: Request, e: Exception):
        return error_response(500, f"internal error ({type(e).__name__}); see the server's log")
