"""The OpenAI API's shapes: the request bodies, their mapping to SamplingParams, and
RequestOutputs as response objects (streamed chunks, or the whole answer).

Types are strict, as OpenAI's are (`"stream": "yes"` and `"seed": "5"` are 400s); a wrong type
is pydantic's to find, a value the engine cannot take an `APIError` (errors.py): either way a 400
naming the field (`param`) in OpenAI's error body. Unknown fields are accepted (clients send new
ones), but a known field that would change the answer if honoured and is not supported (`tools`,
`suffix`, `best_of` > n, ...) is refused, never ignored. vLLM's extra fields are taken too:
`ignore_eos`, `min_tokens`, `top_k`, `min_p`, `repetition_penalty`, `stop_token_ids`,
`include_stop_str_in_output`, `skip_special_tokens`, `guided_json` / `guided_regex` /
`guided_choice`, `prompt_logprobs` (not streamed, as in vLLM) and
`stream_options.continuous_usage_stats` (with `include_usage`: usage in every chunk).
"""
import dataclasses
import itertools
import time
from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field

from nanoinfer.entrypoints.errors import APIError, api_error
from nanoinfer.sampling_params import GuidedDecodingParams, RequestOutputKind, SamplingParams

# fields we do not support, and the values of theirs that change nothing
REFUSED = {"tools": (None, []), "functions": (None, []), "tool_choice": (None, "none", "auto"),
           "function_call": (None, "none", "auto"), "suffix": (None, ""), "guided_grammar": (None,),
           "use_beam_search": (None, False), "audio": (None,), "modalities": (None, ["text"]),
           "allowed_token_ids": (None,)}
# vLLM's guided_* fields, and the GuidedDecodingParams field of each (response_format's: json)
GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice"}
# a logit_bias key: a token id, as a string (JSON's keys are)
TokenId = Annotated[str, Field(pattern="^[0-9]+$")]


class StreamOptions(BaseModel):
    model_config = ConfigDict(strict=True, extra="allow")
    include_usage: bool | None = False
    continuous_usage_stats: bool | None = False   # (vLLM's; only with include_usage)


class SamplingFields(BaseModel):
    model_config = ConfigDict(strict=True, extra="allow")
    model: str | None = None
    max_tokens: int | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    stop: str | list[str] | None = None
    n: int = 1
    best_of: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[TokenId, Annotated[float, Field(ge=-100, le=100)]] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    response_format: dict | None = None
    ignore_eos: bool = False   # vLLM's extra fields
    min_tokens: int = 0
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    guided_json: dict | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    prompt_logprobs: int | None = None


class CompletionRequest(SamplingFields):
    # (tried in this order: pydantic's "smart" unions try every member, 7x slower on token ids)
    prompt: Annotated[list[int] | str | list[str] | list[list[int]],
                      Field(union_mode="left_to_right")]
    max_tokens: int | None = 16   # (OpenAI's default for completions)
    logprobs: int | None = None
    echo: bool = False


class ChatCompletionRequest(SamplingFields):
    messages: list[dict]
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None


def check_fields(request) -> None:
    """The fields that must be refused rather than ignored, and those OpenAI only takes together."""
    given = request.model_extra or {}
    for name, harmless in REFUSED.items():
        if given.get(name) not in harmless:
            raise APIError(400, f"{name} is not supported by this server", name)
    if request.best_of not in (None, request.n):
        raise APIError(400, f"best_of={request.best_of} is not supported: it must equal n",
                       "best_of")
    if request.stream_options is not None and not request.stream:
        raise APIError(400, "stream_options is only allowed with stream: true", "stream_options")
    if request.stream and (request.prompt_logprobs or 0) > 0:   # (as in vLLM)
        raise APIError(400, "prompt_logprobs are not streamed (stream: true)", "prompt_logprobs")


def guided_decoding(request) -> GuidedDecodingParams | None:
    """response_format, or vLLM's guided_json / guided_regex / guided_choice: one at most (two
    are refused, naming both, never one silently taken over the other)."""
    given = {name: getattr(request, name) for name in GUIDED}
    fmt = request.response_format or {"type": "text"}
    if fmt.get("type") == "json_object":
        given["response_format"] = {"type": "object"}
    elif fmt.get("type") == "json_schema":
        spec = fmt.get("json_schema")
        given["response_format"] = spec.get("schema") if isinstance(spec, dict) else None
        if not isinstance(given["response_format"], dict):
            raise APIError(400, "response_format json_schema needs json_schema.schema, an object",
                           "response_format")
    elif fmt.get("type") != "text":
        raise APIError(400, f"response_format type {fmt.get('type')!r} is not one of text, "
                            "json_object, json_schema", "response_format")
    given = {name: value for name, value in given.items() if value is not None}
    if len(given) > 1:
        raise APIError(400, f"one constraint at most: {' and '.join(given)} were both given",
                       next(iter(given)))
    if not given:
        return None
    (name, value), = given.items()
    return GuidedDecodingParams(**{GUIDED.get(name, "json"): value})


def field_names(request, chat: bool) -> dict[str, str]:
    """SamplingParams' fields by the names the request gave them (the others: the same)."""
    guided = [name for name in GUIDED if getattr(request, name) is not None]
    chat_max = chat and request.max_completion_tokens is not None
    return {"guided_decoding": (guided or ["response_format"])[0],
            "prompt": "messages" if chat else "prompt",
            "logprobs": "top_logprobs" if chat else "logprobs",
            "max_tokens": "max_completion_tokens" if chat_max else "max_tokens"}


def sampling_params(request, prompt_lens: list[int], chat: bool, max_model_len: int
                    ) -> SamplingParams:
    check_fields(request)
    names = field_names(request, chat)
    longest = max(prompt_lens)   # (of the request's prompts)
    if longest >= max_model_len:
        raise APIError(400, f"the prompt has {longest} tokens; this model's maximum context "
                            f"length is {max_model_len} (prompt and output)", names["prompt"])
    max_tokens = getattr(request, names["max_tokens"])
    if max_tokens is not None and longest + max_tokens > max_model_len:
        raise APIError(400, f"this model's maximum context length is {max_model_len} tokens; the "
                            f"prompt has {longest} and {names['max_tokens']} asks for "
                            f"{max_tokens} more", names["max_tokens"])
    if chat and request.top_logprobs is not None and not request.logprobs:
        raise APIError(400, "top_logprobs needs logprobs: true", "top_logprobs")
    logprobs = request.logprobs
    if chat:
        logprobs = (request.top_logprobs or 0) if request.logprobs else None
    prompt_logprobs = request.prompt_logprobs
    if prompt_logprobs is None and not chat and request.echo:
        prompt_logprobs = logprobs
    fields = {name: getattr(request, name) for name in (
        "temperature", "top_p", "top_k", "min_p", "seed", "n", "presence_penalty",
        "frequency_penalty", "repetition_penalty", "ignore_eos", "min_tokens", "stop",
        "stop_token_ids", "include_stop_str_in_output", "skip_special_tokens")}
    try:
        return SamplingParams(
            **fields, max_tokens=max_tokens, logprobs=logprobs, prompt_logprobs=prompt_logprobs,
            guided_decoding=guided_decoding(request),
            logit_bias={int(k): v for k, v in (request.logit_bias or {}).items()} or None,
            output_kind=RequestOutputKind.DELTA if request.stream else RequestOutputKind.FINAL_ONLY)
    except ValueError as e:
        raise api_error(e, names) from e


class Chunker:
    """RequestOutputs as OpenAI's response objects: streamed chunks, or the whole answer. Choice
    `i * n + j` is sample j of prompt i; `echo` puts each prompt (and its logprobs) first;
    `continuous_usage`: every chunk carries its choice's usage so far."""

    def __init__(self, request_id: str, model: str, chat: bool, n: int, prompts: list[dict],
                 top_n: int | None, echo: bool, tokenizer, continuous_usage: bool = False):
        self.id = request_id
        self.model = model
        self.chat = chat
        self.n = n
        self.continuous_usage = continuous_usage
        self.created = int(time.time())
        self.prompts = prompts
        self.top_n = top_n
        self.echo = echo
        self.tokenizer = tokenizer
        self.completion_tokens: dict[int, int] = {}   # per choice
        self.offsets: dict[int, int] = {}   # per choice: the length of its tokens' texts so far
        # per prompt: its tokens found in the prefix cache, or loaded (kv_transfer/); its logprobs
        self.cached_tokens = [0] * len(prompts)
        self.prompt_logprobs = [None] * len(prompts)

    def head(self, suffix: str = "") -> dict:
        kind = "chat.completion" if self.chat else "text_completion"
        return {"id": self.id, "object": kind + suffix, "created": self.created,
                "model": self.model}

    def choice(self, i: int, out, c, delta: bool) -> dict:
        index = i * self.n + c.index
        self.cached_tokens[i] = out.num_cached_tokens
        first = index not in self.completion_tokens
        self.completion_tokens[index] = self.completion_tokens.get(index, 0) + len(c.token_ids)
        self.prompt_logprobs[i] = self.prompt_logprobs[i] or out.prompt_logprobs   # (sent once)
        text, tokens = c.text, c.logprobs
        if first and self.echo:   # the prompt first, its first token without a logprob
            prompt = self.prompts[i].get("prompt")
            if prompt is None:
                prompt = self.tokenizer.decode(out.prompt_token_ids) if self.tokenizer else ""
            text = prompt + text
            if tokens is not None:
                first_token = {out.prompt_token_ids[0]: None}
                tokens = [first_token] + (self.prompt_logprobs[i] or [None])[1:] + tokens
        choice = {"index": index, "logprobs": self.logprobs(tokens, index),
                  "finish_reason": c.finish_reason, "stop_reason": c.stop_reason}
        if not self.chat:
            return choice | {"text": text}
        if delta:
            return choice | {"delta": ({"role": "assistant"} if first else {}) | {"content": text}}
        return choice | {"message": {"role": "assistant", "content": text}}

    def logprobs(self, entries, index: int) -> dict | None:
        if entries is None:
            return None
        if not self.chat:
            return self.completion_logprobs(entries, index)

        def item(lp) -> dict:
            token = lp.decoded_token
            return {"token": token, "logprob": lp.logprob, "bytes": list(token.encode())}
        return {"content": [item(next(iter(e.values()))) | {"top_logprobs": [
            item(lp) for lp in sorted(e.values(), key=lambda lp: lp.rank) if lp.rank <= self.top_n]}
            for e in entries]}

    def completion_logprobs(self, entries, index: int) -> dict:
        """tokens, token_logprobs, top_logprobs and text_offset (an echoed first token: no
        logprob)."""
        def name(t, lp) -> str:   # (without a tokenizer a token is named by its id)
            text = lp.decoded_token if lp is not None else \
                self.tokenizer and self.tokenizer.decode([t])
            return f"token_id:{t}" if text is None else text
        sampled = [next(iter(e.items())) for e in entries]
        tokens = [name(*s) for s in sampled]
        # (the same, streamed or not)
        offsets = list(itertools.accumulate(map(len, tokens), initial=self.offsets.get(index, 0)))
        self.offsets[index] = offsets.pop()
        # ("reversed": of tokens with the same name, the first wins)
        top = [None if lp is None else {name(t, x): x.logprob for t, x in reversed(e.items())}
               for e, (_, lp) in zip(entries, sampled)]
        return {"tokens": tokens, "token_logprobs": [lp and lp.logprob for _, lp in sampled],
                "top_logprobs": top, "text_offset": offsets}

    def usage(self) -> dict:
        prompt_tokens = sum(len(p["prompt_token_ids"]) for p in self.prompts)
        return usage(prompt_tokens, sum(self.completion_tokens.values())) | {
            "prompt_tokens_details": {"cached_tokens": sum(self.cached_tokens)}}

    def deltas(self, i: int, out) -> list[dict]:
        """One chunk per sample the output brings."""
        return [self.delta(i, out, c) for c in out.outputs]

    def delta(self, i: int, out, c) -> dict:
        choice = self.choice(i, out, c, True)
        so_far = None
        if self.continuous_usage:   # (vLLM's: the choice's prompt, and its tokens so far)
            so_far = usage(len(out.prompt_token_ids), self.completion_tokens[choice["index"]])
        return self.head(".chunk" if self.chat else "") | {"choices": [choice], "usage": so_far}

    def usage_chunk(self) -> dict:
        return self.head(".chunk" if self.chat else "") | {"choices": [], "usage": self.usage()}

    def final(self, outs: list) -> dict:
        choices = [self.choice(i, out, c, False) for i, out in enumerate(outs) for c in out.outputs]
        prompt_logprobs = [prompt_logprobs_body(entries) for entries in self.prompt_logprobs]
        body = self.head() | {"choices": choices, "usage": self.usage()}
        if self.chat:   # (where vLLM puts them: in a chat's response, in a completion's choices)
            return body | {"prompt_logprobs": prompt_logprobs[0]}
        for choice in choices:
            choice["prompt_logprobs"] = prompt_logprobs[choice["index"] // self.n]
        return body


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def prompt_logprobs_body(entries: list | None) -> list | None:
    """vLLM's prompt_logprobs: per prompt token (None for the first) {token id: {"logprob",
    "rank", "decoded_token"}} (JSON writes the ids as strings)."""
    if entries is None:
        return None
    return [e and {t: dataclasses.asdict(lp) for t, lp in e.items()} for e in entries]
