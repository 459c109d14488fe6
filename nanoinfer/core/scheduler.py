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

The step is described to the model runner by a `SchedulerOutput` (messages.py): a sequence is sent
whole when admitted, then only what changed. A scheduled sequence is advanced at once
(`num_computed_tokens`), and one whose step reaches its last token gets an output placeholder: so
the next step can be scheduled while this one still runs on the GPU (async scheduling), its decode
reading the token this step samples. A sequence whose placeholders already reach its max_tokens or
max_model_len is not scheduled again. `update_from_output` then appends the sampled tokens and
applies the token-level stops (EOS, stop_token_ids, max_tokens, max_model_len) to each in order; a
token sampled for a sequence that stopped (or was aborted) meanwhile is dropped.

KV connectors (kv_transfer/): a waiting request whose prompt blocks a connector has is admitted
with blocks for them and nothing to compute; its step loads them, and it waits
(WAITING_FOR_REMOTE_KVS) until that step's output says how many were good, which then count as
computed. A producer's steps list the full prompt blocks they compute, to be saved. A request that
wants its prompt's logprobs reads no cached blocks: every prompt position is computed. Pipeline
parallelism (P stages, core/engine_core.py): a sequence with a step in flight is skipped, and a step
takes at most max_num_seqs / P sequences, so that P steps in flight hold disjoint ones. Speculative
decoding (spec_decode/): a decoding sequence's drafts are scheduled after its known tokens, in the
same budget, trimmed so that the step cannot run past max_tokens or max_model_len. The step counts
them as computed; `update_from_output` takes the rejected ones back off `num_computed_tokens`
(their slots are overwritten later) before it appends the emitted tokens.
"""
import time
from collections import deque

from nanoinfer.config import Config
from nanoinfer.core.block_manager import BlockManager
from nanoinfer.core.messages import (EngineCoreOutput, ModelRunnerOutput, NewRequestData,
                                      SchedulerOutput)
from nanoinfer.core.sequence import Sequence, SequenceStatus
from nanoinfer.spec_decode.metrics import SpecDecodingStats
from nanoinfer.spec_decode.ngram_proposer import NgramProposer


class Scheduler:

    def __init__(self, config: Config, block_manager: BlockManager, kv_connector=None):
        self.max_num_seqs = config.max_num_seqs
        self.pipelined = config.pipeline_parallel_size > 1
        self.max_seqs_per_step = -(-config.max_num_seqs // config.pipeline_parallel_size)
        self.max_num_batched_tokens = config.max_num_batched_tokens
        self.max_model_len = config.max_model_len
        self.eos_token_ids, self.block_manager = config.eos_token_ids, block_manager
        self.requests: dict[int, Sequence] = {}   # every live sequence, by seq_id
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.finished_seq_ids: set[int] = set()   # since the last step, for the runner to forget
        self.unstepped_outputs: list[EngineCoreOutput] = []   # finished without a step (a failed grammar)
        self.num_preemptions = 0
        self.num_guided = 0   # live sequences with a grammar (structured output)
        spec = config.speculative
        self.ngram = None if spec is None or spec.method != "ngram" else NgramProposer(
            spec.num_speculative_tokens, spec.prompt_lookup_min, spec.prompt_lookup_max, self.max_model_len)
        self.spec_stats = SpecDecodingStats()
        # EAGLE's drafts write k positions past a step: their slots are allocated with it
        self.lookahead = spec.num_speculative_tokens if spec is not None and spec.method == "eagle" else 0
        self.kv_connector = kv_connector   # (kv_transfer/: its scheduler side)

    def add(self, seq: Sequence) -> None:
        self.requests[seq.seq_id] = seq
        if seq.grammar is not None:
            seq.status = SequenceStatus.WAITING_FOR_FSM
            self.num_guided += 1
        self.waiting.append(seq)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput(finished_seq_ids=self.finished_seq_ids)
        self.finished_seq_ids = set()
        budget = self.max_num_batched_tokens
        i = 0   # running sequences first
        while i < len(self.running) and budget > 0 and len(out.num_scheduled_tokens) < self.max_seqs_per_step:
            seq = self.running[i]
            i += 1
            if (seq.reaches_max_tokens or (self.pipelined and seq.num_output_placeholders)
                    or seq.status == SequenceStatus.WAITING_FOR_REMOTE_KVS):
                continue   # a token of it is in flight (its last; or pipelined), or its KV blocks are loading
            drafts = self.drafts_that_fit(seq, budget) if seq.spec_token_ids else []
            num_new = min(seq.num_tokens_with_placeholders + len(drafts) - seq.num_computed_tokens, budget)
            new_blocks = None
            if drafts:   # drafts never preempt anyone: without room for them, go without
                new_blocks = self.block_manager.allocate_slots(seq, num_new + self.lookahead_of(seq, num_new))
                if new_blocks is None:
                    drafts, num_new = [], num_new - len(drafts)
            if new_blocks is None:
                new_blocks = self.allocate_or_preempt(seq, num_new + self.lookahead_of(seq, num_new), out)
            if new_blocks is None:
                break      # it was the newest running sequence, preempted itself
            if drafts:
                out.scheduled_spec_decode_tokens[seq.seq_id] = drafts
            seq.num_scheduled_drafts = len(drafts)
            cached = out.scheduled_cached_reqs
            cached.seq_ids.append(seq.seq_id)
            cached.new_token_ids.append(seq.token_ids[seq.num_tokens_sent:])
            cached.new_block_ids.append(new_blocks)
            cached.num_computed_tokens.append(seq.num_computed_tokens)
            self.advance(seq, num_new, out)
            budget -= num_new

        i = 0   # the first waiting sequence not passed over (its grammar still compiling)
        while (i < len(self.waiting) and budget > 0 and not out.preempted_seq_ids
               and len(self.running) < self.max_num_seqs and len(out.num_scheduled_tokens) < self.max_seqs_per_step):
            seq = self.waiting[i]
            if seq.status == SequenceStatus.WAITING_FOR_FSM and not self.grammar_ready(seq):
                i += not seq.is_finished   # (a finished one left the queue)
                continue
            if self.pipelined and seq.num_output_placeholders:   # preempted with its token in flight
                i += 1
                continue
            computed = self.block_manager.get_computed_blocks(seq)
            if seq.prompt_logprobs is not None:   # (it wants every prompt position's logits)
                computed = []
            if self.lookahead and computed:   # EAGLE: the draft layer's keys at a cached block's last
                computed = computed[:-1]      # position came from the token after it, which may differ
            bs = self.block_manager.block_size
            num_cached, external = len(computed) * bs, self.external_blocks(seq, len(computed))
            num_new = 0 if external else min(seq.num_tokens - num_cached, budget)   # (loading: nothing yet)
            lookahead = self.lookahead_of(seq, num_cached + num_new - seq.num_computed_tokens)
            if self.block_manager.allocate_slots(seq, len(external) * bs + num_new + lookahead, computed) is None:
                break
            del self.waiting[i]
            seq.first_scheduled_time = seq.first_scheduled_time or time.time()
            seq.status = SequenceStatus.WAITING_FOR_REMOTE_KVS if external else SequenceStatus.RUNNING
            seq.num_computed_tokens = num_cached
            if seq.num_cached_tokens is None and not external:
                seq.num_cached_tokens = num_cached
            self.running.append(seq)
            out.scheduled_new_reqs.append(NewRequestData(
                seq_id=seq.seq_id, token_ids=list(seq.token_ids), num_prompt_tokens=seq.num_prompt_tokens,
                sampling_params=seq.sampling_params, block_ids=list(seq.block_table),
                num_computed_tokens=num_cached))
            if external:
                out.kv_loads[seq.seq_id] = list(zip(seq.block_table[len(computed):], external))
                seq.num_tokens_sent = seq.num_tokens
                continue
            self.advance(seq, num_new, out)
            budget -= num_new
        return out

    def allocate_or_preempt(self, seq: Sequence, num_new: int, out: SchedulerOutput) -> list[int] | None:
        """Blocks for `num_new` more tokens of running `seq`, preempting the newest running
        sequences until they fit; None if `seq` itself had to be preempted."""
        while (new_blocks := self.block_manager.allocate_slots(seq, num_new)) is None:
            victim = self.running.pop()
            self.block_manager.free(victim)
            victim.status, victim.num_computed_tokens = SequenceStatus.WAITING, 0
            victim.spec_token_ids = []
            self.waiting.appendleft(victim)
            out.preempted_seq_ids.add(victim.seq_id)
            self.num_preemptions += 1
            if victim is seq:
                return None
        return new_blocks

    def advance(self, seq: Sequence, num_new: int, out: SchedulerOutput) -> None:
        """Count `seq`'s scheduled tokens as computed; enter the blocks they fill in the prefix cache."""
        out.num_scheduled_tokens[seq.seq_id] = num_new
        seq.num_tokens_sent = seq.num_tokens
        seq.num_computed_tokens += num_new
        if seq.num_computed_tokens - seq.num_scheduled_drafts == seq.num_tokens_with_placeholders:   # it samples
            seq.num_output_placeholders += 1
        bs = self.block_manager.block_size
        if seq.num_computed_tokens // bs > (seq.num_computed_tokens - num_new) // bs:   # a block filled up
            self.block_manager.cache_full_blocks(seq)
            if self.kv_connector is not None and self.kv_connector.saves:   # its full prompt blocks
                for i in range((seq.num_computed_tokens - num_new) // bs,
                               min(seq.num_computed_tokens, seq.num_prompt_tokens) // bs):
                    out.kv_saves.append((seq.block_table[i], seq.block_hashes[i]))

    def external_blocks(self, seq: Sequence, num_computed_blocks: int) -> list[int]:
        """The hashes of the prompt blocks after the cached ones that the KV connector has (one
        prompt token at least is computed; with EAGLE, as from the prefix cache, the last block)."""
        if self.kv_connector is None or seq.prompt_logprobs is not None:   # (those compute it all)
            return []
        hashes = seq.block_hashes[num_computed_blocks:(seq.num_tokens - 1) // self.block_manager.block_size]
        return hashes[:max(self.kv_connector.num_matched_blocks(hashes) - bool(self.lookahead), 0)]

    def has_guided(self, sched: SchedulerOutput) -> bool:
        """Does the step hold a sequence with a grammar? (No scan while none is live.)"""
        return bool(self.num_guided) and any(self.requests[s].grammar is not None
                                             for s in sched.num_scheduled_tokens if s in self.requests)

    def grammar_ready(self, seq: Sequence) -> bool:
        """Is `seq`'s grammar compiled? A grammar that failed to compile finishes it ("abort")."""
        try:
            if not seq.grammar.ready():
                return False
        except Exception as e:   # (the constraint was checked when added: too many states, say)
            self.finish(seq, "abort", f"guided decoding failed: {e}")
            self.unstepped_outputs.append(EngineCoreOutput(seq.seq_id, [], None, 0, "abort", seq.stop_reason))
            return False
        seq.status = SequenceStatus.WAITING
        return True

    def drafts_that_fit(self, seq: Sequence, budget: int) -> list[int]:
        """The drafts of `seq` that its step can score: within the budget, and such that the
        accepted drafts and the target's own token stay within max_tokens and max_model_len."""
        drafts, seq.spec_token_ids = seq.spec_token_ids, []
        room = min(budget - (seq.num_tokens - seq.num_computed_tokens),
                   seq.max_tokens - seq.num_output_tokens - 1)
        drafts = drafts[:max(room, 0)]
        return seq.grammar.valid_drafts(drafts) if seq.grammar is not None else drafts

    def lookahead_of(self, seq: Sequence, num_new: int) -> int:
        """EAGLE's slots past the step (0 without EAGLE)."""
        return max(min(self.lookahead, self.max_model_len - seq.num_computed_tokens - num_new), 0)

    def update_from_output(self, runner_output: ModelRunnerOutput) -> list[EngineCoreOutput]:
        """Append each sampled sequence's new tokens, applying the token-level stops to each in order."""
        self.update_prompts(runner_output)
        outputs, lp, lp_row = [], runner_output.logprobs, 0
        for row, (seq_id, token_ids) in enumerate(zip(runner_output.seq_ids, runner_output.sampled_token_ids)):
            lp_row += len(token_ids)
            seq = self.requests.get(seq_id)
            if seq is None:
                continue   # stopped or aborted while this step ran
            assert seq.num_output_placeholders > 0, f"sequence {seq_id} got a token it did not expect"
            seq.num_output_placeholders -= 1
            num_drafts, seq.num_scheduled_drafts = seq.num_scheduled_drafts, 0
            if num_drafts:   # the rejected drafts' keys and values do not count
                seq.num_computed_tokens -= num_drafts - (len(token_ids) - 1)
                self.spec_stats.observe(num_drafts, len(token_ids) - 1)
            new_token_ids = []
            for token_id in token_ids:
                seq.append_token(token_id)
                if seq.grammar is not None:
                    seq.grammar.accept(token_id)
                new_token_ids.append(token_id)
                if seq.num_tokens % self.block_manager.block_size == 0:   # it completed a block
                    self.block_manager.cache_full_blocks(seq)
                if self.check_stop(seq, token_id):
                    break
            new_logprobs = None
            if seq.sampling_params.logprobs is not None:
                first = lp_row - len(token_ids)
                new_logprobs = [(lp.logprob_token_ids[r], lp.logprobs[r], lp.sampled_token_ranks[r])
                                for r in range(first, first + len(new_token_ids))]
            if not seq.is_finished:   # the next step's drafts
                if self.ngram is not None:
                    seq.spec_token_ids = self.ngram.propose(seq)
                elif runner_output.spec_token_ids is not None:
                    seq.spec_token_ids = runner_output.spec_token_ids[row]
            outputs.append(EngineCoreOutput(
                seq_id, new_token_ids, new_logprobs, seq.num_cached_tokens, seq.finish_reason,
                seq.stop_reason, num_drafts, len(token_ids) - 1))
            if seq.num_output_tokens == len(new_token_ids):   # its first: with its prompt's news
                outputs[-1].prompt_logprobs = seq.prompt_logprobs
                outputs[-1].scheduled_time = seq.first_scheduled_time
        return outputs

    def update_prompts(self, runner_output: ModelRunnerOutput) -> None:
        """What a step did for prompts: the KV blocks it loaded (now computed), the logprobs of
        prompt tokens (kept until the first output token goes out with them)."""
        for seq_id, num_good in (runner_output.kv_loaded or {}).items():
            seq = self.requests.get(seq_id)
            if seq is not None and seq.status == SequenceStatus.WAITING_FOR_REMOTE_KVS:
                seq.status = SequenceStatus.RUNNING
                seq.num_computed_tokens += num_good * self.block_manager.block_size
                seq.num_cached_tokens = seq.num_computed_tokens
                self.block_manager.cache_full_blocks(seq)
        for seq_id, (first, rows) in (runner_output.prompt_logprobs or {}).items():
            if (seq := self.requests.get(seq_id)) is not None:
                seq.prompt_logprobs[first - 1:first - 1 + len(rows.logprobs)] = zip(
                    rows.logprob_token_ids, rows.logprobs, rows.sampled_token_ranks)

    def check_stop(self, seq: Sequence, token_id: int) -> bool:
        params = seq.sampling_params
        if not params.ignore_eos and token_id in self.eos_token_ids:
            self.finish(seq, "stop")
        elif token_id in params.stop_token_ids:
            self.finish(seq, "stop", token_id)
        elif seq.num_output_tokens >= seq.max_tokens:   # (or max_model_len: see add_request)
            self.finish(seq, "length")
        return seq.is_finished

    def finish(self, seq: Sequence, reason: str, stop_reason: int | str | None = None) -> None:
        """End `seq` (also used for stop strings and aborts) and free its blocks."""
        if seq.status in (SequenceStatus.RUNNING, SequenceStatus.WAITING_FOR_REMOTE_KVS):
            self.running.remove(seq)
            self.finished_seq_ids.add(seq.seq_id)   # the runner holds it: tell it to forget it
        elif seq.status in (SequenceStatus.WAITING, SequenceStatus.WAITING_FOR_FSM):
            self.waiting.remove(seq)
        self.block_manager.free(seq)
        if self.kv_connector is not None:   # (it may hold blocks of the request)
            self.kv_connector.request_finished(seq.block_hashes)
        self.num_guided -= seq.grammar is not None
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason, seq.stop_reason = reason, stop_reason
        self.requests.pop(seq.seq_id, None)
