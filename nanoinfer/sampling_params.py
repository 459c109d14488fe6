"""How to sample one request's output, and when to stop it (vLLM's fields, names and defaults).

Every field is checked when the object is made, so a bad value is a ValueError that names the
field (a `ValidationError`, its `parameter` the field), raised before any request is queued. The
fields are keyword-only: `SamplingParams(0.5)` is an error rather than a temperature.
"""
import math
from dataclasses import dataclass, field
from enum import IntEnum

from nanoinfer.exceptions import ValidationError
from nanoinfer.utils import is_int


class RequestOutputKind(IntEnum):
    CUMULATIVE = 0   # each output of a request holds everything generated so far
    DELTA = 1        # each output holds only what is new since the previous one (streaming)
    FINAL_ONLY = 2   # one output, when the request finishes (what LLM.generate uses)


@dataclass(kw_only=True)
class GuidedDecodingParams:
    """Constrain the output to a language (structured_output/): exactly one of a JSON schema (a
    dict or its JSON text), a regular expression the whole output must match, or a list of
    choices, one of which the output is."""
    json: dict | str | None = None
    regex: str | None = None
    choice: list[str] | None = None

    def __post_init__(self):
        given = [name for name in ("json", "regex", "choice") if getattr(self, name) is not None]
        if len(given) != 1:
            raise ValidationError("GuidedDecodingParams needs exactly one of json, regex and "
                                  f"choice, got {given or 'none'}", parameter="guided_decoding")
        ok = {"json": isinstance(self.json, (dict, str)), "regex": isinstance(self.regex, str),
              "choice": isinstance(self.choice, list) and bool(self.choice)
              and all(isinstance(c, str) for c in self.choice)}[given[0]]
        if not ok:
            want = {"json": "a dict or a string", "regex": "a string",
                    "choice": "a non-empty list of strings"}
            raise ValidationError(f"GuidedDecodingParams.{given[0]} must be {want[given[0]]}, "
                                  f"got {getattr(self, given[0])!r}", parameter="guided_decoding")


@dataclass(kw_only=True)
class SamplingParams:
    # Independent samples of the prompt, returned as one request's outputs.
    n: int = 1
    # 0 means greedy (argmax).
    temperature: float = 1.0
    # Keep the smallest set of tokens whose probability reaches top_p.
    top_p: float = 1.0
    # Keep the k most likely tokens; 0 or -1 keeps all.
    top_k: int = 0
    # Drop tokens less likely than min_p times the most likely one.
    min_p: float = 0.0
    # Subtracted once from the logit of each token the output has.
    presence_penalty: float = 0.0
    # Subtracted from a token's logit once per time the output has it.
    frequency_penalty: float = 0.0
    # For tokens of the prompt or the output: positive logits are divided by it, negative ones
    # multiplied.
    repetition_penalty: float = 1.0
    # Private randomness: the same seed gives the same output in any batch.
    seed: int | None = None
    # None: until the context (max_model_len) is full.
    max_tokens: int | None = 16
    # EOS, stop_token_ids and stop strings are ignored until this many tokens are out.
    min_tokens: int = 0
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    # The log-probabilities of the sampled token and of the top N, at each step.
    logprobs: int | None = None
    # The same for each prompt token, given those before it.
    prompt_logprobs: int | None = None
    # Token id -> a number added to its logit before sampling.
    logit_bias: dict[int, float] | None = None
    skip_special_tokens: bool = True
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    guided_decoding: GuidedDecodingParams | None = None

    def __post_init__(self):
        self.stop = [self.stop] if isinstance(self.stop, str) else _as_list(self.stop)
        self.stop_token_ids = _as_list(self.stop_token_ids)
        if self.top_k == -1:
            self.top_k = 0
        for name, ok, why in self.checks():
            if not ok:
                raise ValidationError(f"SamplingParams.{name} {why}, got {getattr(self, name)!r}",
                                      parameter=name)
        self.output_kind = RequestOutputKind(self.output_kind)

    def checks(self) -> list[tuple[str, bool, str]]:
        """(field, is it valid, what it must be) for every field."""
        return [
            ("n", is_int(self.n, 1), "must be an integer >= 1"),
            ("temperature", _real(self.temperature, 0), "must be a finite number >= 0"),
            ("top_p", _real(self.top_p, 0, 1) and self.top_p > 0, "must be a number in (0, 1]"),
            ("top_k", is_int(self.top_k, 0), "must be an integer >= 0, or -1 (all)"),
            ("min_p", _real(self.min_p, 0, 1), "must be a number in [0, 1]"),
            ("repetition_penalty", _real(self.repetition_penalty) and self.repetition_penalty > 0,
             "must be a finite number > 0"),
            ("seed", self.seed is None or is_int(self.seed, -2**63, 2**63 - 1),
             "must be None or a 64-bit integer"),
            ("max_tokens", self.max_tokens is None or is_int(self.max_tokens, 1),
             "must be None or an integer >= 1"),
            ("min_tokens", is_int(self.min_tokens, 0, self.max_tokens or math.inf),
             f"must be an integer in [0, max_tokens={self.max_tokens}]"),
            ("stop", isinstance(self.stop, list)
             and all(isinstance(s, str) and s for s in self.stop),
             "must be a string or a list of non-empty strings"),
            ("stop_token_ids", isinstance(self.stop_token_ids, list)
             and all(is_int(t, 0) for t in self.stop_token_ids),
             "must be a list of integers >= 0"),
            ("logit_bias", self.logit_bias is None or (isinstance(self.logit_bias, dict) and all(
                is_int(t, 0) and _real(b) for t, b in self.logit_bias.items())),
             "must be None or a dict of token ids >= 0 to finite numbers"),
            ("output_kind", self.output_kind in list(RequestOutputKind),
             "must be a RequestOutputKind"),
            ("guided_decoding", self.guided_decoding is None
             or isinstance(self.guided_decoding, GuidedDecodingParams),
             "must be None or a GuidedDecodingParams"),
        ] + [(name, _real(getattr(self, name), -2, 2), "must be a number in [-2, 2]")
             for name in ("presence_penalty", "frequency_penalty")
        ] + [(name, getattr(self, name) is None or is_int(getattr(self, name), 0),
              "must be None or an integer >= 0") for name in ("logprobs", "prompt_logprobs")
        ] + [(name, isinstance(getattr(self, name), bool), "must be True or False")
             for name in ("include_stop_str_in_output", "ignore_eos", "skip_special_tokens")]

    @property
    def greedy(self) -> bool:
        """Temperatures below 1e-5 sample greedily, as in vLLM (logits / T would overflow)."""
        return self.temperature < 1e-5


def _as_list(value):
    """None and a tuple as lists; anything else as it is (its check says if it is wrong)."""
    return list(value or ()) if value is None or isinstance(value, tuple) else value


def _real(value, low: float = -math.inf, high: float = math.inf) -> bool:
    """Is `value` a finite number (not a bool) in [low, high]?"""
    return isinstance(value, (int, float)) and not isinstance(value, bool) \
        and math.isfinite(value) and low <= value <= high
