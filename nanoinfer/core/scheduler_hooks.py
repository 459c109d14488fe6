"""The scheduler's side of the optional mechanisms, apart from its base path (scheduler.py).

Each method here is one named call of `Scheduler`'s base path, or of the engine core's step, so
that the plain scheduler reads first and each mechanism reads as a chapter of its own:

- speculative decoding (spec_decode/): `drafts_that_fit` trims a sequence's drafts to the step's
  budget, max_tokens and max_model_len (and to what its grammar allows); `settle_drafts` takes
  the rejected ones back off `num_computed_tokens` when the step's tokens come; `next_drafts`
  proposes the next step's (n-gram here; EAGLE's and Medusa's come from the runner);
- KV connectors (kv_transfer/): `external_blocks` asks the connector for a waiting request's
  prompt blocks after its cached prefix, `load_external` has the step load them (the request
  waits in WAITING_FOR_REMOTE_KVS), `update_prompts` counts the good ones as computed, and
  `save_external` lists the full prompt blocks a producer's step computes;
- prompt logprobs: `computed_blocks` computes every prompt position of a request that wants
  them (no cached prefix; with EAGLE, the last cached block is computed again), and
  `update_prompts` keeps them until the first output token goes out with them;
- structured output (structured_output/): a request waits in WAITING_FOR_FSM until its grammar
  is compiled (`grammar_ready`; one that fails to compile finishes it, with an output of its
  own), and `has_guided` / `guided_samples` tell the engine core which of a step's sequences
  need a mask;
- `forget`: what the mechanisms hold of a finished sequence is dropped.
"""
from nanoinfer.config import Config
from nanoinfer.core.messages import EngineCoreOutput, ModelRunnerOutput, SchedulerOutput
from nanoinfer.core.sequence import Sequence, SequenceStatus
from nanoinfer.spec_decode.metrics import SpecDecodingStats
from nanoinfer.spec_decode.ngram_proposer import NgramProposer


class SchedulerHooks:
    """Mixed into `Scheduler`, whose state (`requests`, `block_manager`, `block_size`,
    `lookahead`) and `finish` it uses; the state below is the mechanisms' own."""

    def init_mechanisms(self, config: Config, kv_connector) -> None:
        """The mechanisms' state, beside the scheduler's own."""
        # Structured output: the live sequences with a grammar, and the outputs of those that
        # finished outside a step (their grammar failed to compile).
        self.guided: set[int] = set()
        self.unstepped_outputs: list[EngineCoreOutput] = []
        # Speculative decoding: n-gram drafts are proposed here (EAGLE's and Medusa's by the
        # runner).
        spec = config.speculative
        self.ngram = None
        if spec is not None and spec.method == "ngram":
            self.ngram = NgramProposer(spec.num_speculative_tokens, spec.prompt_lookup_min,
                                       spec.prompt_lookup_max, config.max_model_len)
        self.spec_stats = SpecDecodingStats()
        # A KV connector's scheduler side (kv_transfer/).
        self.kv_connector = kv_connector

    def schedule_drafts(self, seq: Sequence, drafts: list[int], out: SchedulerOutput) -> None:
        """Send the drafts of `seq` that its step scores (none: a plain step)."""
        if drafts:
            out.scheduled_spec_decode_tokens[seq.seq_id] = drafts
        seq.num_scheduled_drafts = len(drafts)

    def drafts_that_fit(self, seq: Sequence, budget: int) -> list[int]:
        """The drafts of `seq` that its step can score: within the budget, and such that the
        accepted drafts and the target's own token stay within max_tokens and max_model_len."""
        room = min(budget, seq.max_tokens - seq.num_output_tokens - 1)
        drafts = seq.spec_token_ids[:max(room, 0)]
        seq.spec_token_ids = []
        return seq.grammar.valid_drafts(drafts) if seq.grammar is not None else drafts

    def computed_blocks(self, seq: Sequence) -> list[int]:
        """The cached prefix `seq` starts from: none for a request that wants every prompt
        position's logits; with EAGLE, not the last cached block, whose draft-layer keys at its
        last position came from the token after it, which may differ."""
        if seq.prompt_logprobs is not None:
            return []
        computed = self.block_manager.get_computed_blocks(seq)
        return computed[:-1] if self.lookahead and computed else computed

    def external_blocks(self, seq: Sequence, num_computed_blocks: int) -> list[int]:
        """The hashes of the prompt blocks after the cached ones that the KV connector has (one
        prompt token at least is computed; with EAGLE, as from the prefix cache, the last
        block)."""
        # A request that wants its prompt's logprobs computes every position.
        if self.kv_connector is None or seq.prompt_logprobs is not None:
            return []
        hashes = seq.block_hashes[num_computed_blocks:(seq.num_tokens - 1) // self.block_size]
        num_matched = self.kv_connector.num_matched_blocks(hashes) - bool(self.lookahead)
        return hashes[:max(num_matched, 0)]

    def load_external(self, seq: Sequence, num_computed_blocks: int, external: list[int],
                      out: SchedulerOutput) -> None:
        """Ask the step to fill the blocks after the cached ones from the connector."""
        seq.status = SequenceStatus.WAITING_FOR_REMOTE_KVS
        out.kv_loads[seq.seq_id] = list(zip(seq.block_table[num_computed_blocks:], external))
        seq.num_tokens_sent = seq.num_tokens

    def save_external(self, seq: Sequence, first_block: int, out: SchedulerOutput) -> None:
        """A producer's: list the full prompt blocks from `first_block` on that the step
        computes, to save."""
        if self.kv_connector is None or not self.kv_connector.saves:
            return
        end = min(seq.num_computed_tokens, seq.num_prompt_tokens) // self.block_size
        out.kv_saves += [(seq.block_table[i], seq.block_hashes[i]) for i in range(first_block, end)]

    def update_prompts(self, runner_output: ModelRunnerOutput) -> None:
        """What a step did for prompts: the KV blocks it loaded (now computed), the logprobs of
        prompt tokens (kept until the first output token goes out with them)."""
        for seq_id, num_good in (runner_output.kv_loaded or {}).items():
            seq = self.requests.get(seq_id)
            if seq is not None and seq.status == SequenceStatus.WAITING_FOR_REMOTE_KVS:
                seq.status = SequenceStatus.RUNNING
                seq.num_computed_tokens += num_good * self.block_size
                seq.num_cached_tokens = seq.num_computed_tokens
                self.block_manager.cache_full_blocks(seq)
        for seq_id, (first, rows) in (runner_output.prompt_logprobs or {}).items():
            if (seq := self.requests.get(seq_id)) is not None:
                seq.prompt_logprobs[first - 1:first - 1 + len(rows.logprobs)] = zip(
                    rows.logprob_token_ids, rows.logprobs, rows.sampled_token_ranks)

    def settle_drafts(self, seq: Sequence, num_accepted: int) -> int:
        """Take the rejected drafts of the step back off `num_computed_tokens`; the number
        scored."""
        num_drafts = seq.num_scheduled_drafts
        seq.num_scheduled_drafts = 0
        # The rejected drafts' keys and values do not count.
        if num_drafts:
            seq.num_computed_tokens -= num_drafts - num_accepted
            self.spec_stats.observe(num_drafts, num_accepted)
        return num_drafts

    def next_drafts(self, seq: Sequence, runner_output: ModelRunnerOutput, row: int) -> list[int]:
        """Drafts for the next step of `seq`: n-gram's from its tokens, or the runner's."""
        if self.ngram is not None:
            return self.ngram.propose(seq.seq_id, seq.token_ids)
        return [] if runner_output.spec_token_ids is None else runner_output.spec_token_ids[row]

    def add_grammar(self, seq: Sequence) -> None:
        """A guided sequence waits until its grammar is compiled."""
        seq.status = SequenceStatus.WAITING_FOR_FSM
        self.guided.add(seq.seq_id)

    def has_guided(self, sched: SchedulerOutput) -> bool:
        """Does the step hold a sequence with a grammar?"""
        return bool(self.guided) and not self.guided.isdisjoint(sched.num_scheduled_tokens)

    def guided_samples(self, sched: SchedulerOutput) -> list[tuple[int, object, list[int]]]:
        """(seq_id, grammar, drafts) of the step's guided sequences that sample (those with a
        token in flight: the step's own, once the step before has been processed)."""
        return [(seq_id, seq.grammar, sched.scheduled_spec_decode_tokens.get(seq_id, []))
                for seq_id in sched.num_scheduled_tokens if seq_id in self.guided
                and (seq := self.requests[seq_id]).num_output_placeholders]

    def grammar_ready(self, seq: Sequence) -> bool:
        """Is `seq`'s grammar compiled? A grammar that failed to compile finishes it ("abort")."""
        try:
            if not seq.grammar.ready():
                return False
        # The constraint was checked when it was added; its compilation failed anyway (too
        # many states, say).
        except Exception as e:
            self.finish(seq, "abort", f"guided decoding failed: {e}")
            self.unstepped_outputs.append(
                EngineCoreOutput(seq_id=seq.seq_id, new_token_ids=[], num_cached_tokens=0,
                                 finish_reason="abort", stop_reason=seq.stop_reason))
            return False
        seq.status = SequenceStatus.WAITING
        return True

    def take_unstepped_outputs(self) -> list[EngineCoreOutput]:
        outputs = self.unstepped_outputs
        self.unstepped_outputs = []
        return outputs

    def forget(self, seq: Sequence) -> None:
        """Drop what the optional mechanisms hold of a finished sequence."""
        self.guided.discard(seq.seq_id)
        if self.ngram is not None:
            self.ngram.remove(seq.seq_id)
