"""A request in flight: its tokens, how many of them are in the KV cache, and its blocks.

`num_computed_tokens` is the engine's one measure of progress: tokens whose keys and values are
in the paged KV cache. A step schedules `num_tokens - num_computed_tokens` more of them, all at
once for a decode (one token) or in chunks for a long prompt. A sequence samples only when its
step reaches its last token. Preemption resets `num_computed_tokens` to 0: prompt and output so far
are computed again as one longer prompt, and the output is unchanged.

With async scheduling the next step is scheduled before this step's token is known: that token
is a placeholder (`num_output_placeholders`), counted in the length the scheduler plans with
but not yet in `token_ids`.
"""
from enum import Enum, auto
from itertools import count

from nanoinfer.sampling_params import SamplingParams


class SequenceStatus(Enum):
    WAITING = auto()
    RUNNING = auto()
    FINISHED = auto()


class Sequence:
    _counter = count()

    def __init__(self, prompt_token_ids: list[int], sampling_params: SamplingParams,
                 prompt: str | None = None, request_id: str | None = None):
        self.seq_id = next(Sequence._counter)
        self.request_id = request_id if request_id is not None else str(self.seq_id)
        self.prompt = prompt
        self.token_ids = list(prompt_token_ids)
        self.num_prompt_tokens = len(prompt_token_ids)
        self.sampling_params = sampling_params
        self.status = SequenceStatus.WAITING
        self.num_computed_tokens = 0
        self.num_cached_tokens = 0      # prompt tokens found in the prefix cache at admission
        self.num_output_placeholders = 0  # tokens being sampled by steps still in flight
        self.block_table: list[int] = []
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None
        self.logprobs: list[dict[int, float]] | None = [] if sampling_params.logprobs is not None else None
        self.output_text = ""

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_tokens_with_placeholders(self) -> int:
        """The length the scheduler plans with: known tokens and those still being sampled."""
        return len(self.token_ids) + self.num_output_placeholders

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.token_ids[:self.num_prompt_tokens]

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def is_finished(self) -> bool:
        return self.status == SequenceStatus.FINISHED

    def append_token(self, token_id: int) -> None:
        self.token_ids.append(token_id)
