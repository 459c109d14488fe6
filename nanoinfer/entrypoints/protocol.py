"""The OpenAI API's shapes: the request bodies, their mapping to SamplingParams, the error body,
and RequestOutputs as response objects (a streamed chunk, or the whole answer).

A wrong type in a body is pydantic's to find (a 400 naming the field); a value the engine cannot
take is an `APIError` (a 400 naming the parameter, 404 for an unknown model); either way the body
is OpenAI's `{"error": {"message", "type", "param", "code"}}`.
"""
import time

from pydantic import BaseModel

from nanoinfer.sampling_params import GuidedDecodingParams, RequestOutputKind, SamplingParams


class SamplingFields(BaseModel):
    model: str | None = None
    max_tokens: int | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    stop: str | list[str] | None = None
    n: int = 1
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    stream: bool = False
    stream_options: dict | None = None
    response_format: dict | None = None
    ignore_eos: bool = False   # vLLM's extra fields
    min_tokens: int = 0


class CompletionRequest(SamplingFields):
    prompt: str | list[int]
    max_tokens: int | None = 16   # (OpenAI's default for completions)
    logprobs: int | None = None


class ChatCompletionRequest(SamplingFields):
    messages: list[dict]
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None


class APIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None):
        super().__init__(message)
        self.status, self.param = status, param


def error_body(status: int, message: str, param: str | None = None) -> dict:
    kind = {401: "AuthenticationError", 404: "NotFoundError", 405: "MethodNotAllowedError"}.get(
        status, "BadRequestError" if status < 500 else "InternalServerError")
    return {"error": {"message": message, "type": kind, "param": param, "code": status}}


def sampling_params(request, prompt_len: int, chat: bool, max_model_len: int) -> SamplingParams:
    if request.n != 1:
        raise APIError(400, "n must be 1 (several choices per request are not supported yet)", "n")
    if prompt_len >= max_model_len:
        raise APIError(400, f"the prompt has {prompt_len} tokens; this model's maximum context length is "
                            f"{max_model_len} (prompt and output)", "messages" if chat else "prompt")
    max_tokens = request.max_tokens
    if chat and request.max_completion_tokens is not None:
        max_tokens = request.max_completion_tokens
    if max_tokens is not None and prompt_len + max_tokens > max_model_len:
        raise APIError(400, f"this model's maximum context length is {max_model_len} tokens; the prompt has "
                            f"{prompt_len} and max_tokens asks for {max_tokens} more", "max_tokens")
    guided, fmt = None, request.response_format or {"type": "text"}
    if fmt.get("type") == "json_object":
        guided = GuidedDecodingParams(json={"type": "object"})
    elif fmt.get("type") == "json_schema":
        spec = fmt.get("json_schema")
        schema = spec.get("schema") if isinstance(spec, dict) else None
        if not isinstance(schema, dict):
            raise APIError(400, "response_format json_schema needs json_schema.schema, an object", "response_format")
        guided = GuidedDecodingParams(json=schema)
    elif fmt.get("type") != "text":
        raise APIError(400, f"response_format type {fmt.get('type')!r} is not one of text, json_object, "
                            "json_schema", "response_format")
    if chat and request.top_logprobs is not None and not request.logprobs:
        raise APIError(400, "top_logprobs needs logprobs: true", "top_logprobs")
    logprobs = request.logprobs if not chat else (request.top_logprobs or 0) if request.logprobs else None
    try:
        return SamplingParams(
            max_tokens=max_tokens, temperature=request.temperature, top_p=request.top_p, top_k=request.top_k,
            min_p=request.min_p, seed=request.seed, stop=request.stop, presence_penalty=request.presence_penalty,
            frequency_penalty=request.frequency_penalty, repetition_penalty=request.repetition_penalty,
            ignore_eos=request.ignore_eos, min_tokens=request.min_tokens, logprobs=logprobs, guided_decoding=guided,
            output_kind=RequestOutputKind.DELTA if request.stream else RequestOutputKind.FINAL_ONLY)
    except ValueError as e:
        raise APIError(400, str(e)) from e


class Chunker:
    """RequestOutputs as OpenAI's response objects: streamed chunks, or the whole answer."""

    def __init__(self, request_id: str, model: str, chat: bool, prompt_tokens: int, top_n: int | None):
        self.id, self.model, self.chat, self.created = request_id, model, chat, int(time.time())
        self.prompt_tokens, self.completion_tokens, self.first, self.top_n = prompt_tokens, 0, True, top_n
        self.cached_tokens = 0   # prompt tokens not computed: found in the prefix cache, or loaded (kv_transfer/)

    def head(self, suffix: str = "") -> dict:
        kind = "chat.completion" if self.chat else "text_completion"
        return {"id": self.id, "object": kind + suffix, "created": self.created, "model": self.model}

    def choice(self, out, delta: bool) -> dict:
        c, self.cached_tokens = out.outputs[0], out.num_cached_tokens
        self.completion_tokens = self.completion_tokens + len(c.token_ids) if delta else len(c.token_ids)
        choice = {"index": 0, "logprobs": self.logprobs(c.logprobs), "finish_reason": c.finish_reason,
                  "stop_reason": c.stop_reason}
        if not self.chat:
            return choice | {"text": c.text}
        if delta:
            choice["delta"] = ({"role": "assistant"} if self.first else {}) | {"content": c.text}
            self.first = False
            return choice
        return choice | {"message": {"role": "assistant", "content": c.text}}

    def logprobs(self, entries) -> dict | None:
        if entries is None:
            return None
        if not self.chat:   # (without a tokenizer a token is named by its id)
            def name(t, lp):
                return f"token_id:{t}" if lp.decoded_token is None else lp.decoded_token
            sampled = [next(iter(e.items())) for e in entries]
            return {"tokens": [name(*s) for s in sampled], "token_logprobs": [lp.logprob for _, lp in sampled],
                    "top_logprobs": [{name(t, lp): lp.logprob for t, lp in reversed(e.items())}   # (the first wins)
                                     for e in entries]}

        def item(lp) -> dict:
            return {"token": lp.decoded_token, "logprob": lp.logprob, "bytes": list(lp.decoded_token.encode())}
        return {"content": [item(next(iter(e.values()))) | {"top_logprobs": [
            item(lp) for lp in sorted(e.values(), key=lambda lp: lp.rank) if lp.rank <= self.top_n]}
            for e in entries]}

    def usage(self) -> dict:
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": self.completion_tokens,
                "total_tokens": self.prompt_tokens + self.completion_tokens,
                "prompt_tokens_details": {"cached_tokens": self.cached_tokens}}

    def delta(self, out) -> dict:
        return self.head(".chunk" if self.chat else "") | {"choices": [self.choice(out, True)], "usage": None}

    def usage_chunk(self) -> dict:
        return self.head(".chunk" if self.chat else "") | {"choices": [], "usage": self.usage()}

    def final(self, out) -> dict:
        return self.head() | {"choices": [self.choice(out, False)], "usage": self.usage()}
