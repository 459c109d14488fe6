"""Continuous batching under a token budget (vLLM V1's scheduler).

Every step has a budget of `max_num_batched_tokens` tokens and at most `max_num_seqs`
sequences. There is no separate prefill or decode phase: a sequence simply has
`num_tokens - num_computed_tokens` tokens to go, one for a decode, many for a prompt.

1. Running sequences first, oldest first (`schedule_running`). Each gets its tokens (a long
   prompt only what is left of the budget: it is chunked over several steps). If the block
   manager has no room, the newest running sequence is preempted (blocks freed, sent back to the
   front of the waiting queue to be recomputed later), until the request fits or is itself the
   one preempted.
2. Then waiting sequences in arrival order (FCFS, `schedule_waiting`), each starting from its
   longest cached prefix, while budget, sequence slots and blocks last. None are admitted in a
   step that preempted.

The step is described to the model runner by a `SchedulerOutput` (messages.py): a sequence is
sent whole when admitted, then only what changed. A scheduled sequence is advanced at once
(`num_computed_tokens`), and one whose step reaches its last token gets an output placeholder:
so the next step can be scheduled while this one still runs on the GPU (async scheduling), its
decode reading the token this step samples. A sequence whose placeholders already reach its
max_tokens or max_model_len is not scheduled again. `update_from_output` then appends the
sampled tokens and applies the token-level stops (EOS, stop_token_ids, max_tokens,
max_model_len) to each in order; a token sampled for a sequence that stopped (or was aborted)
meanwhile is dropped.

That is the whole base path. The optional mechanisms enter it through named calls whose bodies,
and the state only they use, are in scheduler_hooks.py (each does nothing without its mechanism):
speculative decoding's drafts, a KV connector's blocks, grammars, prompt logprobs. Pipeline
parallelism (P stages, engine/core.py) keeps P steps in flight over disjoint sequences: one with a
token in flight is passed over (`can_schedule`), and a step takes at most `max_seqs_per_step`.
"""
import time
from collections import deque

from nanoinfer.config import Config
from nanoinfer.core.block_manager import BlockManager
from nanoinfer.core.messages import (EngineCoreOutput, ModelRunnerOutput, NewRequestData,
                                     SchedulerOutput)
from nanoinfer.core.scheduler_hooks import SchedulerHooks
from nanoinfer.core.sequence import Sequence, SequenceStatus
from nanoinfer.utils import cdiv

RUNNING = (SequenceStatus.RUNNING, SequenceStatus.WAITING_FOR_REMOTE_KVS)


class Scheduler(SchedulerHooks):
    """The base path; the mechanisms' calls come from `SchedulerHooks`. Its state is set here."""

    def __init__(self, config: Config, block_manager: BlockManager, kv_connector=None):
        self.max_num_seqs = config.max_num_seqs
        self.max_num_batched_tokens = config.max_num_batched_tokens
        self.eos_token_ids = config.eos_token_ids
        self.block_manager = block_manager
        self.block_size = config.block_size
        # Pipeline parallelism (P stages): a step holds at most max_num_seqs / P sequences.
        self.pipelined = config.pipeline_parallel_size > 1
        self.max_seqs_per_step = cdiv(config.max_num_seqs, config.pipeline_parallel_size)
        # EAGLE writes this many positions past a step: every allocation includes them.
        self.lookahead = config.num_lookahead_tokens
        # Every live sequence by seq_id; the queues; and the sequences finished or preempted
        # since the last step was sent, which the runner is to forget.
        self.requests: dict[int, Sequence] = {}
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.finished_seq_ids: set[int] = set()
        self.num_preemptions = 0
        # The optional mechanisms' own state (scheduler_hooks.py).
        self.init_mechanisms(config, kv_connector)

    def add(self, seq: Sequence) -> None:
        self.requests[seq.seq_id] = seq
        self.waiting.append(seq)
        if seq.grammar is not None:
            self.add_grammar(seq)

    def schedule(self) -> SchedulerOutput:
        """Plan one step: the running sequences first (`schedule_running`, with a budget of
        max_num_batched_tokens), then, unless that preempted a sequence, the waiting ones
        (`schedule_waiting`, with the budget left). The step carries the ids of the sequences
        finished since the last step was sent, once. A step with nothing to run is not sent: its
        finished and preempted ids are kept for the next step to carry."""
        out = SchedulerOutput(finished_seq_ids=self.finished_seq_ids)
        self.finished_seq_ids = set()
        budget = self.schedule_running(out, self.max_num_batched_tokens)
        if not out.preempted_seq_ids:
            self.schedule_waiting(out, budget)
        if out.is_empty:
            # The step is not sent: what the runner must forget goes with the next one.
            self.finished_seq_ids |= out.finished_seq_ids | out.preempted_seq_ids
        return out

    def schedule_running(self, out: SchedulerOutput, budget: int) -> int:
        """Schedule the running sequences, oldest first, while the step has room; returns the
        budget left. Each gets `tokens_to_schedule` and blocks for them (`allocate_or_preempt`,
        which may preempt the newest, `seq` too: then the loop ends), and is sent as what
        changed: tokens known since last sent, new blocks, where its step starts."""
        i = 0
        while i < len(self.running) and self.has_room(out, budget):
            seq = self.running[i]
            i += 1
            if not self.can_schedule(seq):
                continue
            num_new, drafts = self.tokens_to_schedule(seq, budget)
            new_blocks = self.allocate_or_preempt(seq, num_new, out)
            if new_blocks is None:
                # It was the newest running sequence, and preempted itself.
                break
            cached = out.scheduled_cached_reqs
            cached.seq_ids.append(seq.seq_id)
            cached.new_token_ids.append(seq.token_ids[seq.num_tokens_sent:])
            cached.new_block_ids.append(new_blocks)
            cached.num_computed_tokens.append(seq.num_computed_tokens)
            self.schedule_drafts(seq, drafts, out)
            self.advance(seq, num_new, out)
            budget -= num_new
        return budget

    def schedule_waiting(self, out: SchedulerOutput, budget: int) -> None:
        """Admit waiting sequences in arrival order while the step has room and fewer than
        max_num_seqs run; stop at the first whose blocks do not fit. Each starts from its cached
        prefix and computes what the budget takes of the rest (or, if a KV connector has its
        next blocks, has them loaded and computes nothing in this step)."""
        i = 0   # the first waiting sequence not passed over
        while i < len(self.waiting) and self.has_room(out, budget) \
                and len(self.running) < self.max_num_seqs:
            seq = self.waiting[i]
            if not self.can_admit(seq):
                if not seq.is_finished:   # (one whose grammar failed has left the queue)
                    i += 1
                continue
            computed = self.computed_blocks(seq)
            num_cached = len(computed) * self.block_size
            external = self.external_blocks(seq, len(computed))
            # A request whose blocks a KV connector loads computes nothing in this step.
            num_new = 0 if external else min(seq.num_tokens - num_cached, budget)
            num_slots = len(external) * self.block_size + num_new
            if self.block_manager.allocate_slots(seq, num_slots, computed_blocks=computed,
                                                 num_lookahead_tokens=self.lookahead) is None:
                return
            self.admit(seq, num_cached, out)
            if external:
                self.load_external(seq, len(computed), external, out)
            else:
                self.advance(seq, num_new, out)
                budget -= num_new

    def has_room(self, out: SchedulerOutput, budget: int) -> bool:
        """Can the step take another sequence?"""
        return budget > 0 and len(out.num_scheduled_tokens) < self.max_seqs_per_step

    def can_schedule(self, seq: Sequence) -> bool:
        """Not if its last token is already in flight (async scheduling), nor, pipelined, any
        token of it, nor while its KV blocks are loading (kv_transfer/)."""
        return not (seq.reaches_max_tokens or (self.pipelined and seq.num_output_placeholders)
                    or seq.status == SequenceStatus.WAITING_FOR_REMOTE_KVS)

    def can_admit(self, seq: Sequence) -> bool:
        """Not while its grammar compiles (structured output), nor, pipelined, while it was
        preempted with a token in flight."""
        if seq.status == SequenceStatus.WAITING_FOR_FSM and not self.grammar_ready(seq):
            return False
        return not (self.pipelined and seq.num_output_placeholders)

    def tokens_to_schedule(self, seq: Sequence, budget: int) -> tuple[int, list[int]]:
        """The tokens of running `seq` the step computes: what it has not computed yet (a
        decode's one token, or what the budget takes of a prompt), then its drafts (speculative
        decoding) where the budget and the free blocks have room; and those drafts."""
        num_new = min(seq.num_tokens_with_placeholders - seq.num_computed_tokens, budget)
        if not seq.spec_token_ids:
            return num_new, []
        drafts = self.drafts_that_fit(seq, budget - num_new)
        # Drafts never preempt anyone: without room for them, the sequence goes without.
        if not self.block_manager.can_allocate(seq, num_new + len(drafts), self.lookahead):
            drafts = []
        return num_new + len(drafts), drafts

    def allocate_or_preempt(self, seq: Sequence, num_new: int, out: SchedulerOutput
                            ) -> list[int] | None:
        """Blocks for `num_new` more tokens of running `seq` (and `self.lookahead` slots past
        them): the block ids appended to its table. Until they fit, the newest running sequence
        is preempted: its blocks are freed, its drafts dropped, it is WAITING again with nothing
        computed, at the front of the waiting queue, and counted (`num_preemptions`,
        `out.preempted_seq_ids`). None if `seq` itself had to be preempted."""
        while (new_blocks := self.block_manager.allocate_slots(
                seq, num_new, num_lookahead_tokens=self.lookahead)) is None:
            victim = self.running.pop()
            self.block_manager.free(victim)
            victim.status = SequenceStatus.WAITING
            victim.num_computed_tokens = 0
            victim.spec_token_ids = []
            self.waiting.appendleft(victim)
            out.preempted_seq_ids.add(victim.seq_id)
            self.num_preemptions += 1
            if victim is seq:
                return None
        return new_blocks

    def admit(self, seq: Sequence, num_cached: int, out: SchedulerOutput) -> None:
        """Move waiting `seq` to the running ones, sent whole to the runner."""
        self.waiting.remove(seq)
        self.running.append(seq)
        seq.first_scheduled_time = seq.first_scheduled_time or time.time()
        seq.status = SequenceStatus.RUNNING
        seq.num_computed_tokens = num_cached
        # (first admission; a KV connector's loaded blocks are counted when they come)
        if seq.num_cached_tokens is None:
            seq.num_cached_tokens = num_cached
        out.scheduled_new_reqs.append(NewRequestData(
            seq_id=seq.seq_id, token_ids=list(seq.token_ids),
            num_prompt_tokens=seq.num_prompt_tokens, sampling_params=seq.sampling_params,
            block_ids=list(seq.block_table), num_computed_tokens=num_cached))

    def advance(self, seq: Sequence, num_new: int, out: SchedulerOutput) -> None:
        """Count `seq`'s `num_new` scheduled tokens (drafts among them) as computed, in the step
        and in `seq`. A step that reaches its last token samples it: one more output
        placeholder. Blocks they fill enter the prefix cache at once (and a producer's saves)."""
        out.num_scheduled_tokens[seq.seq_id] = num_new
        seq.num_tokens_sent = seq.num_tokens
        seq.num_computed_tokens += num_new
        # A step that reaches the sequence's end samples: its token is a placeholder till then.
        known = seq.num_computed_tokens - seq.num_scheduled_drafts
        if known == seq.num_tokens_with_placeholders:
            seq.num_output_placeholders += 1
        first_block = (seq.num_computed_tokens - num_new) // self.block_size
        if seq.num_computed_tokens // self.block_size > first_block:
            self.block_manager.cache_full_blocks(seq)
            self.save_external(seq, first_block, out)

    def update_from_output(self, runner_output: ModelRunnerOutput) -> list[EngineCoreOutput]:
        """Append each sampled sequence's new tokens, applying the token-level stops to each in
        order."""
        self.update_prompts(runner_output)
        outputs = []
        lp_end = 0
        for row, (seq_id, token_ids) in enumerate(zip(runner_output.seq_ids,
                                                      runner_output.sampled_token_ids)):
            lp_start, lp_end = lp_end, lp_end + len(token_ids)
            seq = self.requests.get(seq_id)
            # A sequence that stopped, or was aborted, while this step ran takes none.
            if seq is None:
                continue
            assert seq.num_output_placeholders > 0, f"sequence {seq_id} got an unexpected token"
            seq.num_output_placeholders -= 1
            num_drafts = self.settle_drafts(seq, len(token_ids) - 1)
            new_token_ids = self.append_tokens(seq, token_ids)
            if not seq.is_finished:
                seq.spec_token_ids = self.next_drafts(seq, runner_output, row)
            outputs.append(EngineCoreOutput(
                seq_id=seq_id, new_token_ids=new_token_ids,
                num_cached_tokens=seq.num_cached_tokens, finish_reason=seq.finish_reason,
                stop_reason=seq.stop_reason, num_draft_tokens=num_drafts,
                num_accepted_tokens=len(token_ids) - 1))
            if seq.sampling_params.logprobs is not None:
                lp = runner_output.logprobs
                outputs[-1].new_logprobs = [
                    (lp.logprob_token_ids[r], lp.logprobs[r], lp.sampled_token_ranks[r])
                    for r in range(lp_start, lp_start + len(new_token_ids))]
            # A sequence's first output brings its prompt's logprobs and when it was scheduled.
            if seq.num_output_tokens == len(new_token_ids):
                outputs[-1].prompt_logprobs = seq.prompt_logprobs
                outputs[-1].scheduled_time = seq.first_scheduled_time
        return outputs

    def append_tokens(self, seq: Sequence, token_ids: list[int]) -> list[int]:
        """Append the step's tokens to `seq` up to the first that stops it; those appended."""
        for n, token_id in enumerate(token_ids, start=1):
            seq.append_token(token_id)
            if seq.grammar is not None:
                seq.grammar.accept(token_id)
            if seq.num_tokens % self.block_size == 0:
                self.block_manager.cache_full_blocks(seq)
            if self.check_stop(seq, token_id):
                return token_ids[:n]
        return token_ids

    def check_stop(self, seq: Sequence, token_id: int) -> bool:
        params = seq.sampling_params
        if not params.ignore_eos and token_id in self.eos_token_ids:
            self.finish(seq, "stop")
        elif token_id in params.stop_token_ids:
            self.finish(seq, "stop", token_id)
        # max_model_len bounds max_tokens too.
        elif seq.num_output_tokens >= seq.max_tokens:
            self.finish(seq, "length")
        return seq.is_finished

    def finish(self, seq: Sequence, reason: str, stop_reason: int | str | None = None) -> None:
        """End `seq` (also used for stop strings and aborts) and free its blocks."""
        if seq.status in RUNNING:
            # The runner holds it: the next step tells it to forget it.
            self.running.remove(seq)
            self.finished_seq_ids.add(seq.seq_id)
        elif seq.status != SequenceStatus.FINISHED:
            self.waiting.remove(seq)
        self.block_manager.free(seq)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason, seq.stop_reason = reason, stop_reason
        self.requests.pop(seq.seq_id, None)
        self.forget(seq)
