"""A request in flight, as the scheduler sees it: its tokens, how many are in the KV cache, its
blocks.

`num_computed_tokens` is the engine's one measure of progress: tokens whose keys and values are
in the paged KV cache. A step schedules `num_tokens - num_computed_tokens` more of them, all at
once for a decode (one token) or in chunks for a long prompt. A sequence samples only when its
step reaches its last token. Preemption resets `num_computed_tokens` to 0: prompt and output so far
are computed again as one longer prompt, and the output is unchanged. Only the scheduler changes it.

With async scheduling the next step is scheduled before this step's token is known: that token
is a placeholder (`num_output_placeholders`), counted in the length the scheduler plans with
but not yet in `token_ids`.

`block_hashes` holds the hash of each full block of known tokens, chained to the previous one
(so equal hashes mean equal whole prefixes). They are computed once, as tokens become known, and
serve prefix-cache lookups (and later the KV connector). The hash is 128 bits wide, so blocks are
matched by hash alone: two different prefixes with one hash are as good as impossible.

Progress counters, and the scheduler's methods that change them (core/scheduler.py, and for the
optional mechanisms core/scheduler_hooks.py); nothing else does:

    num_computed_tokens      admit (its cached prefix), advance (+ the step's tokens),
                             allocate_or_preempt (0), settle_drafts (- rejected drafts),
                             update_prompts (+ blocks a KV connector loaded)
    num_output_placeholders  advance (+1 when the step samples), update_from_output (-1)
    num_tokens_sent          advance, load_external (the runner has every known token)
    num_cached_tokens        admit, update_prompts
    spec_token_ids           update_from_output (the next step's drafts), drafts_that_fit and
                             allocate_or_preempt (taken, or dropped)
    num_scheduled_drafts     schedule_drafts, settle_drafts
"""
from enum import Enum, auto

import numpy as np
import xxhash

from nanoinfer.sampling_params import SamplingParams


def hash_block(parent_hash: int | None, token_ids: list[int]) -> int:
    h = xxhash.xxh3_128()
    if parent_hash is not None:
        h.update(parent_hash.to_bytes(16, "little"))
    h.update(np.asarray(token_ids, dtype=np.int64).tobytes())
    return h.intdigest()


class SequenceStatus(Enum):
    # Its grammar (structured output) is still being compiled.
    WAITING_FOR_FSM = auto()
    WAITING = auto()
    # Admitted, while its prompt's KV blocks are being loaded (kv_transfer/).
    WAITING_FOR_REMOTE_KVS = auto()
    RUNNING = auto()
    FINISHED = auto()


class Sequence:

    def __init__(self, seq_id: int, prompt_token_ids: list[int], sampling_params: SamplingParams,
                 max_tokens: int, block_size: int):
        # Unique in the engine: the step messages name it by this.
        self.seq_id = seq_id
        self.token_ids = list(prompt_token_ids)
        self.num_prompt_tokens = len(prompt_token_ids)
        self.sampling_params = sampling_params
        # sampling_params.max_tokens, or what max_model_len leaves after the prompt.
        self.max_tokens = max_tokens
        self.status = SequenceStatus.WAITING
        # The progress counters (see above): tokens in the KV cache; prompt tokens found in the
        # prefix cache at admission (or loaded by a KV connector); tokens being sampled by steps
        # still in flight; known tokens already sent to the model runner; drafts proposed for the
        # next step, and drafts being scored by the step in flight.
        self.num_computed_tokens = 0
        self.num_cached_tokens: int | None = None
        self.num_output_placeholders = 0
        self.num_tokens_sent = 0
        self.spec_token_ids: list[int] = []
        self.num_scheduled_drafts = 0
        self.block_table: list[int] = []
        self.block_size = block_size
        self.block_hashes: list[int] = []
        self.hash_full_blocks()
        # Structured output: its constraint and state (structured_output/).
        self.grammar = None
        # The prompt's logprobs (SamplingParams.prompt_logprobs): a row per token but the first.
        self.prompt_logprobs = None
        if sampling_params.prompt_logprobs is not None:
            self.prompt_logprobs = [None] * (self.num_prompt_tokens - 1)
        # When it was first scheduled (time.time()), for a server's metrics.
        self.first_scheduled_time: float | None = None
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None

    def __repr__(self) -> str:
        """Its id, status and progress: the tokens computed of those known or in flight."""
        return (f"Sequence({self.seq_id}, {self.status.name}, {self.num_computed_tokens} of "
                f"{self.num_tokens_with_placeholders} tokens computed)")

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_tokens_with_placeholders(self) -> int:
        """The length the scheduler plans with: known tokens and those still being sampled."""
        return len(self.token_ids) + self.num_output_placeholders

    @property
    def reaches_max_tokens(self) -> bool:
        """Do the tokens in flight already take it to max_tokens (which max_model_len bounds)?"""
        return self.num_tokens_with_placeholders - self.num_prompt_tokens >= self.max_tokens

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def is_finished(self) -> bool:
        return self.status == SequenceStatus.FINISHED

    def append_token(self, token_id: int) -> None:
        self.token_ids.append(token_id)
        if len(self.token_ids) % self.block_size == 0:
            self.hash_full_blocks()

    def hash_full_blocks(self) -> None:
        """Append to `block_hashes` the hash of each block of `token_ids` that is full and has
        none yet: `hash_block` of the previous block's hash (None for the first block) and the
        block's token ids."""
        bs = self.block_size
        for i in range(len(self.block_hashes), len(self.token_ids) // bs):
            parent = self.block_hashes[-1] if self.block_hashes else None
            self.block_hashes.append(hash_block(parent, self.token_ids[i * bs:(i + 1) * bs]))
