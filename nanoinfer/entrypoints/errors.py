"""The server's errors, in OpenAI's body: `{"error": {"message", "type", "param", "code"}}`.

`param` names the request's field at fault. The engine's own checks raise a `ValidationError`
(nanoinfer/exceptions.py) that carries the parameter's name; `api_error` turns it into the field
as the request named it (SamplingParams' `max_tokens` is a chat's `max_completion_tokens`, its
`logprobs` a chat's `top_logprobs`, a prompt a chat's `messages`, ...).
"""
import re

# (any other status: invalid_request_error below 500, server_error from 500)
ERROR_TYPES = {401: "authentication_error", 404: "not_found_error"}


class APIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None):
        super().__init__(message)
        self.status = status
        self.param = param


def error_body(status: int, message: str, param: str | None = None) -> dict:
    kind = ERROR_TYPES.get(status, "invalid_request_error" if status < 500 else "server_error")
    return {"error": {"message": message, "type": kind, "param": param, "code": status}}


def api_error(error: ValueError, names: dict[str, str]) -> APIError:
    """The engine's ValueError as a 400 naming the field its `parameter` is (names: the request's
    names for SamplingParams' fields), in the API's words ("SamplingParams.x" becomes that name)."""
    parameter = getattr(error, "parameter", None)
    param = names.get(parameter, parameter)
    message = re.sub(r"\b(SamplingParams|GuidedDecodingParams)\.\w+", str(param), str(error))
    # (a chat's max_completion_tokens, where another field's message mentions max_tokens)
    message = re.sub(r"\bmax_tokens\b", names.get("max_tokens", "max_tokens"), message)
    return APIError(400, message, param)
