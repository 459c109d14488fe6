"""What a request returns (vLLM's RequestOutput, CompletionOutput and Logprob).

A request with `SamplingParams(n=k)` has k completions, `outputs[0..k-1]`. Depending on its
`output_kind` the engine returns an output every step with everything so far (CUMULATIVE), every
step with only what is new (DELTA: the new tokens, text and logprobs), or once at the end
(FINAL_ONLY).
"""
from dataclasses import dataclass, field

from nanoinfer.spec_decode.metrics import SpecDecodingStats


@dataclass
class Logprob:
    # Of the model's own distribution: after a grammar's mask (as vLLM's), before the logit
    # biases, penalties, temperature and top-k/top-p/min-p.
    logprob: float
    rank: int | None = None           # 1 = the most likely token
    decoded_token: str | None = None  # the token's own text


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    # sum of the sampled tokens' logprobs (with logprobs=N)
    cumulative_logprob: float | None = None
    logprobs: list[dict[int, Logprob]] | None = None  # per token: the sampled one and the top N
    finish_reason: str | None = None    # "stop" (EOS, stop id or stop string), "length", "abort"
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestMetrics:
    arrival_time: float                 # time.time() when the request was added
    first_scheduled_time: float | None = None   # ... when the core first scheduled it
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None
    num_generation_tokens: int = 0      # of its first sample
    # its drafts (all samples)
    spec_decoding: SpecDecodingStats = field(default_factory=SpecDecodingStats)


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0          # prompt tokens served from the prefix cache
    metrics: RequestMetrics | None = None
    # SamplingParams.prompt_logprobs: per prompt token (None for the first) the token and the top N
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None

    def add(self, later: "RequestOutput") -> None:
        """Merge the request's next DELTA output into this one: the two as one output."""
        mine = {c.index: c for c in self.outputs}
        for c in later.outputs:
            if c.index not in mine:
                self.outputs.append(c)
                continue
            m = mine[c.index]   # (its lists are its own: extended in place)
            m.text += c.text
            m.token_ids += c.token_ids
            if m.logprobs is not None:
                m.logprobs += c.logprobs
            m.cumulative_logprob = c.cumulative_logprob
            m.finish_reason = c.finish_reason
            m.stop_reason = c.stop_reason
        self.outputs.sort(key=lambda c: c.index)
        self.finished = later.finished
        self.metrics = later.metrics
        self.num_cached_tokens = later.num_cached_tokens
        self.prompt_logprobs = self.prompt_logprobs or later.prompt_logprobs
