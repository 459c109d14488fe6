"""The sampling settings of the persistent batch's requests, and a step's sampling metadata.

Each request's `SamplingParams` become one row of a numpy structured array when it is added
(`set_sampling`), beside the token ids blocked until min_tokens (EOS and stop ids) and its logit
biases. For a step, `sampling_metadata` gathers the rows of the requests that sample (with
drafts, k + 1 rows each) into device tensors: temperatures, top-k/top-p/min-p (left out when no
row uses them), a random seed per row (a seeded request's derived from its seed and the index of
the token it samples, so its output does not depend on its batch), the logit biases with -inf
for blocked tokens, the penalties' token counts, and the grammars' mask rows (structured output:
the masks themselves stay on the device in a table, `grammar_masks`).

Mixed into `InputBatch` (input_batch.py), whose arrays it reads.
"""
import itertools
import struct

import numpy as np
import torch
import xxhash

from nanoinfer.core.messages import GrammarOutput
from nanoinfer.layers.sampler import Penalties, SamplingMetadata
from nanoinfer.sampling_params import SamplingParams
from nanoinfer.structured_output import MAX_MASK_ROWS

SAMPLING_FIELDS = np.dtype([
    ("temperature", np.float32), ("top_k", np.int64), ("top_p", np.float32), ("min_p", np.float32),
    ("presence", np.float32), ("frequency", np.float32), ("repetition", np.float32),
    ("seed", np.int64), ("seeded", np.bool_), ("min_tokens", np.int64), ("logprobs", np.int64),
    ("prompt_logprobs", np.int64), ("biased", np.bool_)])


def token_seed(seed: int, index: int) -> int:
    """The seed of a seeded request's output token number `index`: a hash of both, the same on
    every machine and Python version.

    `seed` is any int64 (negative too), `index` >= 0 (0: the first output token). Returns an
    int in [0, 2**63) (it goes into an int64 tensor and seeds a generator), spread over that
    range like a hash's, so that different pairs give different seeds. Python's `hash` will not
    do: it changes between versions, and hash(-1) == hash(-2)."""
    return xxhash.xxh64_intdigest(struct.pack("<qq", seed, index)) & (2**63 - 1)


class SamplingInputs:

    def set_sampling(self, row: int, p: SamplingParams) -> None:
        """Row `row`'s sampling settings."""
        self.sampling[row] = (0.0 if p.greedy else p.temperature, p.top_k, p.top_p, p.min_p,
                              p.presence_penalty, p.frequency_penalty, p.repetition_penalty,
                              p.seed or 0, p.seed is not None, p.min_tokens,
                              -1 if p.logprobs is None else p.logprobs,
                              -1 if p.prompt_logprobs is None else p.prompt_logprobs,
                              bool(p.logit_bias))
        self.stop_ids[row] = p.stop_token_ids + ([] if p.ignore_eos else self.eos_token_ids)
        self.logit_bias[row] = p.logit_bias or {}

    def sampling_metadata(self, step, grammar: GrammarOutput | None = None) -> SamplingMetadata:
        """The sampling metadata of the step's sample rows (`step`: its StepInputs)."""
        rows, ends = step.sample_rows, step.sample_ends
        s = self.sampling[rows]
        # The output index of the token each row samples.
        index = ends - self.num_prompt_tokens[rows]
        seeds = self.rng.integers(2**63, size=len(rows))
        for k in np.flatnonzero(s["seeded"]):
            seeds[k] = token_seed(int(s["seed"][k]), int(index[k]))
        bias = [(k, t, -np.inf) for k in np.flatnonzero(index < s["min_tokens"])
                for t in self.stop_ids[rows[k]]]   # (blocked before min_tokens)
        bias += [(k, t, b) for k in np.flatnonzero(s["biased"])
                 for t, b in self.logit_bias[rows[k]].items()]
        grammar_rows = None if grammar is None else self.grammar_rows(step, grammar)
        temperatures, top_ps, min_ps = self.to_device(np.float32, s["temperature"], s["top_p"],
                                                      s["min_p"])
        seeds, top_ks = self.to_device(np.int64, seeds, s["top_k"])
        # a mask that no row uses is left out
        return SamplingMetadata(
            temperatures=temperatures, top_ks=None if (s["top_k"] == 0).all() else top_ks,
            top_ps=None if (s["top_p"] == 1).all() else top_ps,
            min_ps=None if (s["min_p"] == 0).all() else min_ps, seeds=seeds,
            all_greedy=bool((s["temperature"] == 0).all()),
            max_num_logprobs=int(s["logprobs"].max()) if (s["logprobs"] >= 0).any() else None,
            logit_bias=self.bias_tensors(bias) if bias else None, penalties=self.penalties(step, s),
            grammar_masks=None if grammar is None else self.grammar_masks,
            grammar_rows=grammar_rows)

    def bias_tensors(self, bias: list[tuple[int, int, float]]) -> tuple[torch.Tensor, ...]:
        """(sample rows, token ids, values) on the device."""
        rows, token_ids, values = zip(*bias)
        return (*self.to_device(np.int64, rows, token_ids), *self.to_device(np.float32, values))

    def grammar_rows(self, step, grammar: GrammarOutput) -> torch.Tensor:
        """Write the new masks into the table; each sample row's mask row (0 if unconstrained)."""
        if grammar.new_rows:
            rows_needed = max(grammar.new_rows) + 1
            # The table grows as needed (doubling, up to MAX_MASK_ROWS).
            if self.grammar_masks is None or len(self.grammar_masks) < rows_needed:
                size = max(rows_needed, min(2 * rows_needed, MAX_MASK_ROWS + 1))
                table = torch.full((size, grammar.new_masks.shape[1]), -1, dtype=torch.int32,
                                   device=self.device)
                if self.grammar_masks is not None:
                    table[:len(self.grammar_masks)] = self.grammar_masks
                self.grammar_masks = table
            new_rows, new_masks = self.to_device(np.int32, grammar.new_rows, grammar.new_masks)
            self.grammar_masks[new_rows] = new_masks
        per_request = step.rows_per_request or [1] * len(step.sample_seq_ids)
        first_row = dict(zip(step.sample_seq_ids, itertools.accumulate(per_request, initial=0)))
        rows = np.zeros(len(step.sample_rows), np.int32)
        constrained = [first_row[s] + i for s, n in zip(grammar.seq_ids, grammar.num_rows)
                       for i in range(n)]
        rows[constrained] = grammar.mask_rows
        return self.to_device(np.int32, rows)[0]

    def penalties(self, step, s: np.ndarray) -> Penalties | None:
        """Each penalised row's tokens so far. The last one may not be known on the host yet,
        so it is taken from this step's input on the device (it is the row's last input token)."""
        penalised = (s["presence"] != 0) | (s["frequency"] != 0) | (s["repetition"] != 1)
        which = np.flatnonzero(penalised)
        if not len(which):
            return None
        rows, ends = step.sample_rows[which], step.sample_ends[which]
        cols = np.arange(ends.max())
        token_ids = np.where(cols < (ends - 1)[:, None], self.token_ids[rows, :ends.max()],
                             self.vocab_size)
        token_ids, rows_t, last = self.to_device(np.int64, token_ids, which, ends - 1)
        last_input = step.input_ids[step.logits_indices[rows_t]]
        token_ids[torch.arange(len(which), device=self.device), last] = last_input
        (is_output,) = self.to_device(np.bool_, cols >= self.num_prompt_tokens[rows][:, None])
        presence, frequency, repetition = self.to_device(
            np.float32, s["presence"][which], s["frequency"][which], s["repetition"][which])
        return Penalties(rows_t, token_ids, is_output, presence, frequency, repetition)

