"""Continuous batching under a token budget (vLLM V1's scheduler).

Every step has a budget of `max_num_batched_tokens` tokens and at most `max_num_seqs`
sequences. There is no separate prefill or decode phase: a sequence simply has
`num_tokens - num_computed_tokens` tokens to go, one for a decode, many for a prompt.

1. Running sequences first, oldest first. Each gets its tokens (a long prompt only what is left
   of the budget: it is chunked over several steps). If the block manager has no room, the
   newest running sequence is preempted (blocks freed, sent back to the front of the waiting
   queue to be recomputed later), until the request fits or is itself the one preempted.
2. Then waiting sequences in arrival order (FCFS), each starting from its longest cached prefix,
   while budget, sequence slots and blocks last. None are admitted in a step that preempted.

A scheduled sequence is advanced at once (`num_computed_tokens`), and one whose step reaches its
last token gets an output placeholder: so the next step can be scheduled while this one still
runs on the GPU (async scheduling), its decode reading the token this step samples. A sequence
whose placeholders already reach max_tokens or max_model_len is not scheduled again.

`update_from_output` then fills the placeholders with the sampled tokens and applies the
token-level stops (EOS, stop_token_ids, max_tokens, max_model_len). A token sampled for a
sequence that stopped (or was aborted) meanwhile is dropped.
"""
from collections import deque
from dataclasses import dataclass, field

from nanoinfer.config import Config
from nanoinfer.engine.block_manager import BlockManager
from nanoinfer.engine.sequence import Sequence, SequenceStatus


@dataclass
class SchedulerOutput:
    seqs: list[Sequence]
    num_scheduled_tokens: list[int]
    num_computed_tokens: list[int] = field(default_factory=list)   # each one's tokens already cached
    do_sample: list[bool] = field(default_factory=list)            # does its step reach its last token


class Scheduler:

    def __init__(self, config: Config, block_manager: BlockManager):
        self.max_num_seqs = config.max_num_seqs
        self.max_num_batched_tokens = config.max_num_batched_tokens
        self.max_model_len = config.max_model_len
        self.eos_token_ids = config.eos_token_ids
        self.block_manager = block_manager
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput([], [])
        budget = self.max_num_batched_tokens
        preempted = False

        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            if self.reaches_length_limit(seq):
                i += 1   # its last token is in flight: it finishes when that arrives
                continue
            num_new = min(seq.num_tokens_with_placeholders - seq.num_computed_tokens, budget)
            while not self.block_manager.allocate_slots(seq, num_new):
                victim = self.running.pop()
                self._preempt(victim)
                preempted = True
                if victim is seq:
                    break
            else:
                out.seqs.append(seq)
                out.num_scheduled_tokens.append(num_new)
                budget -= num_new
                i += 1

        while self.waiting and budget > 0 and not preempted and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            computed = self.block_manager.get_computed_blocks(seq)
            num_new = min(seq.num_tokens - len(computed) * self.block_manager.block_size, budget)
            if not self.block_manager.allocate_slots(seq, num_new, computed):
                break
            self.waiting.popleft()
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            out.seqs.append(seq)
            out.num_scheduled_tokens.append(num_new)
            budget -= num_new

        for seq, num_new in zip(out.seqs, out.num_scheduled_tokens):
            out.num_computed_tokens.append(seq.num_computed_tokens)
            seq.num_computed_tokens += num_new
            out.do_sample.append(seq.num_computed_tokens == seq.num_tokens_with_placeholders)
            seq.num_output_placeholders += out.do_sample[-1]
            self.block_manager.cache_full_blocks(seq)
        return out

    def reaches_length_limit(self, seq: Sequence) -> bool:
        """Do the tokens in flight already take `seq` to max_tokens or max_model_len?"""
        num_tokens = seq.num_tokens_with_placeholders
        return (num_tokens - seq.num_prompt_tokens >= seq.sampling_params.max_tokens
                or num_tokens >= self.max_model_len)

    def _preempt(self, seq: Sequence) -> None:
        self.block_manager.free(seq)
        seq.status = SequenceStatus.WAITING
        self.waiting.appendleft(seq)
        self.num_preemptions += 1

    def update_from_output(self, out: SchedulerOutput, sampled: dict[int, int]) -> list[Sequence]:
        """Append each sampled token (`sampled` maps seq_id to it) and apply the token-level stops;
        returns the sequences that got a token."""
        updated = []
        for seq in out.seqs:
            token_id = sampled.get(seq.seq_id)
            if token_id is None:
                continue   # a prompt chunk that is not the last: nothing sampled
            seq.num_output_placeholders -= 1
            if seq.is_finished:
                continue   # stopped or aborted while this step ran
            seq.append_token(token_id)
            self.block_manager.cache_full_blocks(seq)   # the token may complete a computed block
            updated.append(seq)
            params = seq.sampling_params
            if not params.ignore_eos and token_id in self.eos_token_ids:
                self.finish(seq, "stop")
            elif token_id in params.stop_token_ids:
                self.finish(seq, "stop", token_id)
            elif seq.num_output_tokens >= params.max_tokens or seq.num_tokens >= self.max_model_len:
                self.finish(seq, "length")
        return updated

    def finish(self, seq: Sequence, reason: str, stop_reason: int | str | None = None) -> None:
        """End `seq` (also used for stop strings and aborts) and free its blocks."""
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason, seq.stop_reason = reason, stop_reason
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.block_manager.free(seq)
