"""The front end's first half: a prompt and its sampling params become an `EngineCoreRequest`.

Everything that can be wrong with a request is found here, before the core sees it (and only
here: `LLM.generate` checks no prompt of its own), so that a bad request gets a ValueError saying
what is wrong (a `ValidationError`, whose `parameter` names the parameter at fault) and never
disturbs the others: the prompt is tokenized (or its token ids checked), its length held against
max_model_len, token ids against the vocabulary, logprobs against max_logprobs, a guided
request's constraint parsed. The n samples of a request become n sequences with seeds seed,
seed + 1, ...
"""
import copy
import dataclasses
from itertools import count

from transformers import PreTrainedTokenizerBase

from nanoinfer.config import Config
from nanoinfer.core.messages import EngineCoreRequest
from nanoinfer.exceptions import ValidationError
from nanoinfer.sampling_params import SamplingParams
from nanoinfer.structured_output import guided_regex

PromptType = str | list[int] | dict
NO_TOKENIZER = "the engine was started with skip_tokenizer_init"


class InputProcessor:

    def __init__(self, config: Config, tokenizer: PreTrainedTokenizerBase | None):
        self.config = config
        self.tokenizer = tokenizer
        self.seq_counter = count()

    def process(self, request_id: str, prompt: PromptType, params: SamplingParams | None
                ) -> tuple[str | None, EngineCoreRequest]:
        """The prompt's text (if known) and the request; raises ValueError saying what is wrong."""
        params = SamplingParams() if params is None else params
        if not isinstance(request_id, str) or not request_id:
            raise ValidationError(f"request_id must be a non-empty string, got {request_id!r}",
                                  parameter="request_id")
        if not isinstance(params, SamplingParams):
            raise ValidationError("sampling_params must be a SamplingParams, got "
                                  f"{type(params).__name__}", parameter="sampling_params")
        # The caller may change or reuse theirs.
        params = copy.deepcopy(params)
        text, token_ids = self.tokenize(prompt)
        self.validate(token_ids, params)
        grammar = None if params.guided_decoding is None else self.grammar(params)
        # max_model_len holds the prompt and the output.
        room = self.config.max_model_len - len(token_ids)
        max_tokens = min(params.max_tokens or room, room)
        # the samples of n > 1: seeds seed, seed + 1, ...
        children = [params if params.seed is None else dataclasses.replace(
            params, seed=wrap64(params.seed + i)) for i in range(params.n)]
        seq_ids = [next(self.seq_counter) for _ in children]
        return text, EngineCoreRequest(request_id, seq_ids, token_ids, children, max_tokens,
                                       grammar)

    def grammar(self, params: SamplingParams) -> str:
        """The guided request's constraint as a regex, checked by building its DFA once (cached
        for the core, structured_output/): the request's `grammar`."""
        if self.tokenizer is None:
            raise ValidationError(f"guided decoding needs a tokenizer; {NO_TOKENIZER}",
                                  parameter="guided_decoding")
        try:
            return guided_regex(params.guided_decoding)
        except ValueError as e:
            raise ValidationError(f"SamplingParams.guided_decoding: {e}",
                                  parameter="guided_decoding") from e
        # A wrong type somewhere in the constraint.
        except (TypeError, AttributeError, KeyError, RecursionError) as e:
            raise ValidationError("SamplingParams.guided_decoding: malformed constraint "
                                  f"({type(e).__name__}: {e})", parameter="guided_decoding") from e

    def tokenize(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            return prompt, self.encode(prompt)
        if isinstance(prompt, dict) and "prompt_token_ids" in prompt:
            return prompt.get("prompt"), prompt["prompt_token_ids"]
        if isinstance(prompt, dict) and isinstance(prompt.get("prompt"), str):
            return prompt["prompt"], self.encode(prompt["prompt"])
        if isinstance(prompt, list):
            return None, prompt
        raise ValidationError("prompts must be a str, a list of token ids, a dict with 'prompt' or "
                              "'prompt_token_ids', or a list of these; got "
                              f"{type(prompt).__name__}", parameter="prompt")

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        if self.tokenizer is None:
            raise ValidationError(f"text needs a tokenizer ({NO_TOKENIZER}): pass prompt token ids",
                                  parameter="prompt")
        try:
            text.encode()
        # JSON's "\ud800" decodes to such a str.
        except UnicodeEncodeError as e:
            raise ValidationError("the text is not valid Unicode: a lone surrogate at character "
                                  f"{e.start}", parameter="prompt") from None
        return self.tokenizer.encode(text, add_special_tokens=add_special_tokens)

    def chat_prompt(self, messages: list[dict], add_generation_prompt: bool = True) -> dict:
        """A conversation through the model's chat template, as a prompt. A message's content is
        a string or a list of text parts (joined by newlines, as vLLM joins them)."""
        if self.tokenizer is None:
            raise ValidationError(f"chat needs a tokenizer; {NO_TOKENIZER}", parameter="messages")
        conversation = []
        for i, message in enumerate(messages if isinstance(messages, list) else [messages]):
            if not isinstance(message, dict) or not {"role", "content"} <= message.keys():
                raise ValidationError(f"message {i} must be a dict with 'role' and 'content', "
                                      f"got {message!r}", parameter="messages")
            conversation.append({**message, "content": text_of(i, message["content"])})
        try:
            text = self.tokenizer.apply_chat_template(conversation, tokenize=False,
                                                      add_generation_prompt=add_generation_prompt)
        # A template that refuses the conversation (roles out of order, say).
        except Exception as e:
            raise ValidationError(f"the chat template refused the messages: {e}",
                                  parameter="messages") from e
        # the template already wrote any BOS: do not add special tokens again
        return {"prompt": text, "prompt_token_ids": self.encode(text, add_special_tokens=False)}

    def validate(self, token_ids: list[int], params: SamplingParams) -> None:
        if not isinstance(token_ids, list) or not all(type(t) is int for t in token_ids):
            raise ValidationError("prompt token ids must be a list of integers",
                                  parameter="prompt")
        if not token_ids:
            raise ValidationError("the prompt is empty: it must have at least one token",
                                  parameter="prompt")
        if len(token_ids) >= self.config.max_model_len:
            raise ValidationError(f"the prompt has {len(token_ids)} tokens but max_model_len is "
                                  f"{self.config.max_model_len} (prompt and output must fit)",
                                  parameter="prompt")
        vocab_size = self.config.hf_config.vocab_size
        for name, ids in (("prompt", token_ids), ("stop_token_ids", params.stop_token_ids),
                          ("logit_bias", params.logit_bias or ())):
            where = "the prompt" if name == "prompt" else f"SamplingParams.{name}"
            bad = [t for t in ids if not 0 <= t < vocab_size]
            if bad:
                raise ValidationError(f"{where} holds token id {bad[0]}, outside the vocabulary "
                                      f"[0, {vocab_size})", parameter=name)
        if self.tokenizer is None and params.stop:
            raise ValidationError(f"stop strings need a tokenizer; {NO_TOKENIZER}",
                                  parameter="stop")
        max_logprobs = min(self.config.max_logprobs, vocab_size)
        for name in ("logprobs", "prompt_logprobs"):
            if (getattr(params, name) or 0) > max_logprobs:
                raise ValidationError(
                    f"SamplingParams.{name}={getattr(params, name)} is more than this engine "
                    f"returns (max_logprobs={max_logprobs}, an engine option)", parameter=name)


def text_of(i: int, content) -> str:
    """A message's content as text: a string, or text parts joined by newlines (None: empty)."""
    if content is None or isinstance(content, str):
        return content or ""
    if not isinstance(content, list):
        raise ValidationError(f"message {i}: content must be a string or a list of parts, got "
                              f"{content!r}", parameter="messages")
    kinds = [p.get("type") if isinstance(p, dict) else type(p).__name__ for p in content]
    if any(k != "text" or not isinstance(p.get("text"), str) for k, p in zip(kinds, content)):
        raise ValidationError(f"message {i}: content parts must be {{'type': 'text', 'text': "
                              f"str}} (this engine takes text only), got types {kinds}",
                              parameter="messages")
    return "\n".join(p["text"] for p in content)


def wrap64(x: int) -> int:
    """x as a signed 64-bit integer (wrapping around)."""
    return (x + 2**63) % 2**64 - 2**63
