"""How to sample one request's output, and when to stop it (the fields and defaults of vLLM)."""
from dataclasses import dataclass, field


@dataclass
class SamplingParams:
    temperature: float = 1.0      # 0 means greedy (argmax)
    top_p: float = 1.0            # keep the smallest set of tokens whose probability reaches top_p
    top_k: int = 0                # keep the k most likely tokens; 0 or -1 keeps all
    min_p: float = 0.0            # drop tokens less likely than min_p times the most likely one
    seed: int | None = None       # private randomness: same seed, same output in any batch
    max_tokens: int = 16
    min_tokens: int = 0           # EOS and stop_token_ids are blocked until this many are out
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None   # return the log-probabilities of the top-N tokens at each step
    skip_special_tokens: bool = True

    def __post_init__(self):
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.top_k == -1:
            self.top_k = 0
        checks = [
            ("temperature", self.temperature >= 0, "must be >= 0"),
            ("top_p", 0 < self.top_p <= 1, "must be in (0, 1]"),
            ("top_k", isinstance(self.top_k, int) and self.top_k >= 0, "must be a non-negative integer or -1 (all)"),
            ("min_p", 0 <= self.min_p <= 1, "must be in [0, 1]"),
            ("max_tokens", isinstance(self.max_tokens, int) and self.max_tokens >= 1, "must be an integer >= 1"),
            ("min_tokens", isinstance(self.min_tokens, int) and 0 <= self.min_tokens <= self.max_tokens,
             f"must be an integer in [0, max_tokens={self.max_tokens}]"),
            ("stop", all(isinstance(s, str) and s for s in self.stop), "must be non-empty strings"),
            ("stop_token_ids", all(isinstance(t, int) and t >= 0 for t in self.stop_token_ids),
             "must be non-negative integers"),
            ("logprobs", self.logprobs is None or (isinstance(self.logprobs, int) and self.logprobs >= 0),
             "must be None or an integer >= 0"),
            ("seed", self.seed is None or isinstance(self.seed, int), "must be None or an integer"),
        ]
        for name, ok, why in checks:
            if not ok:
                raise ValueError(f"SamplingParams.{name} {why}, got {getattr(self, name)!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0
