"""The model runner's persistent batch: what it knows of each request, kept from step to step.

vLLM's InputBatch, in small. Each request the runner holds owns a row of a few numpy arrays:
`token_ids[row, :num_tokens[row]]` are its tokens known here (the prompt and the output so far),
`block_table[row, :num_blocks[row]]` its blocks, `num_computed_tokens[row]` where this step's
tokens start, and `sampling[row]` its sampling settings. `update` applies a step message
(messages.py): a new request fills its row once, a running one appends only the tokens that
became known and its new blocks. So the message stays small, and a step's inputs are a few
vectorised gathers over the scheduled rows (`prepare_inputs`), not a Python loop over requests.

The one token not known here is a decode's input that the previous step is still sampling (async
scheduling): it is taken from that step's output on the device (`prev_sampled_token_ids`).

Drafts (speculative decoding) are written after a request's known tokens without being counted;
the tokens the step accepts overwrite them when they arrive. A request with k drafts is sampled
at its last k + 1 positions: its logits rows are k + 1 "sample rows", each with the token count
it samples at, so seeds, penalties and min_tokens apply to every row as they would one by one.
A step that only verifies drafts (no longer prompt chunks) gives attention one row per token,
each a single query over its own causal prefix: the same result, computed by the decode kernel,
so the step can replay a CUDA graph like any decode. Each row reads its sequence's keys again
(k + 1 times in all, against once for the multi-query kernel), which the graph's saved launches
pay for only while a graph can run the step: larger steps, and eager engines, are not flattened.
"""
import itertools
import struct
from dataclasses import dataclass

import numpy as np
import torch
import xxhash

from nanoinfer.attention import AttentionMetadata
from nanoinfer.core.messages import GrammarOutput, NewRequestData, SchedulerOutput
from nanoinfer.structured_output import MAX_MASK_ROWS
from nanoinfer.layers.sampler import Penalties, SamplingMetadata

SAMPLING_FIELDS = np.dtype([
    ("temperature", np.float32), ("top_k", np.int64), ("top_p", np.float32), ("min_p", np.float32),
    ("presence", np.float32), ("frequency", np.float32), ("repetition", np.float32),
    ("seed", np.int64), ("seeded", np.bool_), ("min_tokens", np.int64), ("logprobs", np.int64),
    ("prompt_logprobs", np.int64), ("biased", np.bool_)])


def token_seed(seed: int, index: int) -> int:
    """The seed of a seeded request's output token number `index`: a hash of both, the same on
    every machine and Python version."""
    return xxhash.xxh64_intdigest(struct.pack("<qq", seed, index)) & (2**63 - 1)


def append_rows(table: np.ndarray, counts: np.ndarray, rows: np.ndarray, values: list[list[int]]) -> None:
    """Append values[i] to row rows[i] of `table`, after its counts[rows[i]] entries (vectorised)."""
    lens = np.fromiter(map(len, values), np.int64, len(values))
    if not lens.any():
        return
    which = np.repeat(rows, lens)
    offsets = np.arange(len(which)) - np.repeat(np.cumsum(lens) - lens, lens)
    table[which, counts[which] + offsets] = list(itertools.chain.from_iterable(values))
    counts[rows] += lens


@dataclass
class StepInputs:
    input_ids: torch.Tensor            # int64 [tokens]
    positions: torch.Tensor            # int64 [tokens]
    attn_metadata: AttentionMetadata
    logits_indices: torch.Tensor       # int64 [sample rows]: the positions whose logits are sampled
    sample_seq_ids: list[int]          # the requests that sample, in row order
    sample_rows: np.ndarray            # per sample row: the request's row in the persistent batch
    sample_ends: np.ndarray            # per sample row: the position of the token it samples
    draft_token_ids: torch.Tensor | None = None   # int64 [sampling requests, k], padded with -1
    num_drafts: torch.Tensor | None = None        # int64 [sampling requests]
    rows_per_request: list[int] | None = None     # its drafts and one, per sampling request
    # for EAGLE (lookahead > 0): per scheduled request its last position (flat index) and the
    # known token after it (0 if none), and the sampling requests' block tables with lookahead
    last_rows: torch.Tensor | None = None
    next_token_ids: torch.Tensor | None = None
    sample_block_tables: torch.Tensor | None = None
    # requests that want their prompt's logprobs: [(seq_id, position of the first token scored,
    # tokens scored)], the flat positions before those tokens, the tokens, the most top-N asked
    prompt_logprobs: tuple[list, torch.Tensor, torch.Tensor, int] | None = None


class InputBatch:

    def __init__(self, max_num_reqs: int, max_model_len: int, block_size: int, vocab_size: int,
                 eos_token_ids: list[int], device: torch.device, seed: int, lookahead: int = 0):
        self.block_size, self.vocab_size, self.eos_token_ids = block_size, vocab_size, eos_token_ids
        self.lookahead = lookahead   # positions past a step that EAGLE's drafts write
        self.max_flat_rows = 0       # verification steps of up to this many tokens run as decode rows
        self.device = device
        self.token_ids = np.zeros((max_num_reqs, max_model_len), np.int32)   # pages are touched as used
        self.num_tokens = np.zeros(max_num_reqs, np.int64)
        self.num_prompt_tokens = np.zeros(max_num_reqs, np.int64)
        self.num_computed_tokens = np.zeros(max_num_reqs, np.int64)
        self.block_table = np.zeros((max_num_reqs, -(-max_model_len // block_size)), np.int32)
        self.num_blocks = np.zeros(max_num_reqs, np.int64)
        self.sampling = np.zeros(max_num_reqs, SAMPLING_FIELDS)
        self.stop_ids: list[list[int]] = [[] for _ in range(max_num_reqs)]   # blocked before min_tokens
        self.logit_bias: list[dict[int, float]] = [{} for _ in range(max_num_reqs)]
        self.rng = np.random.default_rng(seed)   # the seeds of unseeded requests' draws
        self.grammar_masks: torch.Tensor | None = None   # the structured-output masks (row 0: all allowed)
        self.clear()

    def clear(self) -> None:
        self.rows: dict[int, int] = {}   # seq_id -> row
        self.free_rows = list(range(len(self.num_tokens) - 1, -1, -1))
        self.prev_sampled_token_ids: torch.Tensor | None = None   # the last step's samples, on the device
        self.prev_sample_index: dict[int, int] = {}               # seq_id -> its row in them

    def update(self, sched: SchedulerOutput) -> None:
        for seq_id in sched.finished_seq_ids | sched.preempted_seq_ids:
            row = self.rows.pop(seq_id, None)
            if row is not None:
                self.free_rows.append(row)
        for req in sched.scheduled_new_reqs:
            self.add_request(req)
        cached = sched.scheduled_cached_reqs
        if cached.seq_ids:
            rows = np.fromiter((self.rows[s] for s in cached.seq_ids), np.int64, len(cached.seq_ids))
            append_rows(self.token_ids, self.num_tokens, rows, cached.new_token_ids)
            append_rows(self.block_table, self.num_blocks, rows, cached.new_block_ids)
            self.num_computed_tokens[rows] = cached.num_computed_tokens
        for seq_id, drafts in sched.scheduled_spec_decode_tokens.items():   # after the known tokens
            row = self.rows[seq_id]
            self.token_ids[row, self.num_tokens[row]:self.num_tokens[row] + len(drafts)] = drafts

    def add_request(self, req: NewRequestData) -> None:
        row = self.rows[req.seq_id] = self.free_rows.pop()
        self.token_ids[row, :len(req.token_ids)] = req.token_ids
        self.num_tokens[row], self.num_prompt_tokens[row] = len(req.token_ids), req.num_prompt_tokens
        self.num_computed_tokens[row] = req.num_computed_tokens
        self.block_table[row, :len(req.block_ids)] = req.block_ids
        self.num_blocks[row] = len(req.block_ids)
        p = req.sampling_params
        self.sampling[row] = (0.0 if p.greedy else p.temperature, p.top_k, p.top_p, p.min_p,
                              p.presence_penalty, p.frequency_penalty, p.repetition_penalty,
                              p.seed or 0, p.seed is not None, p.min_tokens,
                              -1 if p.logprobs is None else p.logprobs,
                              -1 if p.prompt_logprobs is None else p.prompt_logprobs,
                              bool(p.logit_bias))
        self.stop_ids[row] = p.stop_token_ids + ([] if p.ignore_eos else self.eos_token_ids)
        self.logit_bias[row] = p.logit_bias or {}

    def to_device(self, dtype: type, *arrays) -> list[torch.Tensor]:
        """Host arrays as device tensors of one dtype, in one copy: packed into one buffer (through
        numpy: torch.tensor(list) costs about a microsecond per element), pinned, copied without
        blocking, and cut into views."""
        flat = [np.asarray(a, dtype=dtype).reshape(-1) for a in arrays]
        buffer = torch.from_numpy(np.concatenate(flat))   # a copy: never a view of the batch
        if self.device.type != "cpu":
            buffer = buffer.pin_memory().to(self.device, non_blocking=True)
        return [v.view(np.shape(a)) for v, a in zip(buffer.split([f.size for f in flat]), arrays)]

    def prepare_inputs(self, sched: SchedulerOutput) -> StepInputs:
        """The step as one flat batch: every scheduled request's new tokens back to back."""
        bs, seq_ids = self.block_size, list(sched.num_scheduled_tokens)
        rows = np.fromiter((self.rows[s] for s in seq_ids), np.int64, len(seq_ids))
        num_new = np.fromiter(sched.num_scheduled_tokens.values(), np.int64, len(seq_ids))
        spec = sched.scheduled_spec_decode_tokens
        num_drafts = np.fromiter((len(spec.get(s, ())) for s in seq_ids), np.int64, len(seq_ids))
        start = self.num_computed_tokens[rows]
        end = start + num_new
        cu_seqlens_q = np.concatenate([[0], np.cumsum(num_new)])
        token_rows = np.repeat(rows, num_new)
        positions = np.arange(cu_seqlens_q[-1]) + np.repeat(start - cu_seqlens_q[:-1], num_new)
        slot_mapping = self.block_table[token_rows, positions // bs].astype(np.int64) * bs + positions % bs
        sample = end >= self.num_tokens[rows]   # the step reaches its last known token, or the one in flight
        # an input still being sampled by the previous step is taken from that step's output
        known = self.num_tokens[token_rows] + (np.repeat(num_drafts, num_new) if spec else 0)   # drafts too
        in_flight = np.flatnonzero(positions >= known)
        owners = np.searchsorted(cu_seqlens_q, in_flight, side="right") - 1
        prev_index = [self.prev_sample_index[seq_ids[i]] for i in owners]
        logits_indices, sample_rows, sample_ends = cu_seqlens_q[1:][sample] - 1, rows[sample], end[sample]
        if spec:   # a request with k drafts samples at its last k + 1 positions
            per_row = num_drafts[sample] + 1
            j = np.arange(per_row.sum()) - np.repeat(np.cumsum(per_row) - per_row, per_row)   # which of them
            logits_indices = np.repeat(logits_indices + 1 - per_row, per_row) + j
            sample_rows, sample_ends = np.repeat(sample_rows, per_row), np.repeat(sample_ends + 1 - per_row, per_row) + j
        q_lens, kv_lens, table_rows = num_new, end, rows
        if spec and num_new.max() <= num_drafts.max() + 1 and len(positions) <= self.max_flat_rows:
            # a verification step that a CUDA graph can run: a row per token
            q_lens, kv_lens, table_rows = np.ones_like(positions), positions + 1, token_rows
        input_ids, positions, slot_mapping, logits_indices, in_flight, prev_index = self.to_device(
            np.int64, self.token_ids[token_rows, positions], positions, slot_mapping,
            logits_indices, in_flight, prev_index)
        if len(in_flight):
            input_ids[in_flight] = self.prev_sampled_token_ids[prev_index]
        cu_q, context_lens, block_tables = self.to_device(
            np.int32, np.concatenate([[0], np.cumsum(q_lens)]), kv_lens,
            self.block_table[table_rows, :-(-end.max() // bs)])
        meta = AttentionMetadata(cu_seqlens_q=cu_q, context_lens=context_lens, slot_mapping=slot_mapping,
                                 block_tables=block_tables, max_seqlen_q=int(q_lens.max()))
        step = StepInputs(input_ids, positions, meta, logits_indices, [s for s, x in zip(seq_ids, sample) if x],
                          sample_rows, sample_ends)
        if spec:
            drafts = [spec.get(s, []) for s in step.sample_seq_ids]
            width = max(map(len, drafts))
            padded = np.array([d + [-1] * (width - len(d)) for d in drafts], np.int64).reshape(-1, width)
            step.draft_token_ids, step.num_drafts = self.to_device(np.int64, padded, per_row - 1)
            step.rows_per_request = per_row.tolist()
        if self.lookahead:
            known = end < self.num_tokens[rows]
            next_ids = np.where(known, self.token_ids[rows, np.minimum(end, self.token_ids.shape[1] - 1)], 0)
            step.last_rows, step.next_token_ids = self.to_device(np.int64, cu_seqlens_q[1:] - 1, next_ids)
            width = min(-(-(int(end.max()) + self.lookahead) // bs), self.block_table.shape[1])
            (step.sample_block_tables,) = self.to_device(np.int32, self.block_table[rows[sample], :width])
        wanted = self.sampling["prompt_logprobs"][rows]   # (-1: not wanted)
        if (wanted >= 0).any():
            step.prompt_logprobs = self.prompt_positions(seq_ids, rows, start, end, cu_seqlens_q,
                                                         wanted)
        return step

    def prompt_positions(self, seq_ids: list[int], rows: np.ndarray, start: np.ndarray,
                         end: np.ndarray, cu_seqlens_q: np.ndarray, wanted: np.ndarray
                         ) -> tuple | None:
        """Where the step's prompt tokens that want logprobs are predicted: the positions of the
        chunk before each (the prompt's last position predicts the output, not a prompt token)."""
        layout, index, targets = [], [], []
        for i in np.flatnonzero(wanted >= 0):
            positions = np.arange(start[i], min(end[i], self.num_prompt_tokens[rows[i]] - 1))
            if len(positions):
                layout.append((seq_ids[i], int(start[i]) + 1, len(positions)))
                index.append(cu_seqlens_q[i] + positions - start[i])
                targets.append(self.token_ids[rows[i], positions + 1])
        if not layout:
            return None
        num_top = int(wanted.max())
        index, targets = self.to_device(np.int64, np.concatenate(index), np.concatenate(targets))
        return layout, index, targets, num_top

    def sampling_metadata(self, step: StepInputs, grammar: GrammarOutput | None = None) -> SamplingMetadata:
        rows, ends = step.sample_rows, step.sample_ends
        s = self.sampling[rows]
        index = ends - self.num_prompt_tokens[rows]   # the output index of the token being sampled
        seeds = self.rng.integers(2**63, size=len(rows))
        for k in np.flatnonzero(s["seeded"]):
            seeds[k] = token_seed(int(s["seed"][k]), int(index[k]))
        bias = [(k, t, -np.inf) for k in np.flatnonzero(index < s["min_tokens"])
                for t in self.stop_ids[rows[k]]]   # (blocked before min_tokens)
        bias += [(k, t, b) for k in np.flatnonzero(s["biased"])
                 for t, b in self.logit_bias[rows[k]].items()]
        grammar_rows = None if grammar is None else self.grammar_rows(step, grammar)
        temperatures, top_ps, min_ps = self.to_device(np.float32, s["temperature"], s["top_p"], s["min_p"])
        seeds, top_ks = self.to_device(np.int64, seeds, s["top_k"])
        return SamplingMetadata(   # a mask no row uses is left out
            temperatures=temperatures, top_ks=None if (s["top_k"] == 0).all() else top_ks,
            top_ps=None if (s["top_p"] == 1).all() else top_ps,
            min_ps=None if (s["min_p"] == 0).all() else min_ps, seeds=seeds, all_greedy=bool((s["temperature"] == 0).all()),
            max_num_logprobs=int(s["logprobs"].max()) if (s["logprobs"] >= 0).any() else None,
            logit_bias=self.bias_tensors(bias) if bias else None, penalties=self.penalties(step, s),
            grammar_masks=None if grammar is None else self.grammar_masks, grammar_rows=grammar_rows)

    def bias_tensors(self, bias: list[tuple[int, int, float]]) -> tuple[torch.Tensor, ...]:
        """(sample rows, token ids, values) on the device."""
        rows, token_ids, values = zip(*bias)
        return (*self.to_device(np.int64, rows, token_ids), *self.to_device(np.float32, values))

    def grammar_rows(self, step: StepInputs, grammar: GrammarOutput) -> torch.Tensor:
        """Write the new masks into the table; each sample row's mask row (0 if unconstrained)."""
        if grammar.new_rows:
            rows_needed = max(grammar.new_rows) + 1
            if self.grammar_masks is None or len(self.grammar_masks) < rows_needed:   # grow it
                size = max(rows_needed, min(2 * rows_needed, MAX_MASK_ROWS + 1))
                table = torch.full((size, grammar.new_masks.shape[1]), -1, dtype=torch.int32, device=self.device)
                if self.grammar_masks is not None:
                    table[:len(self.grammar_masks)] = self.grammar_masks
                self.grammar_masks = table
            new_rows, new_masks = self.to_device(np.int32, grammar.new_rows, grammar.new_masks)
            self.grammar_masks[new_rows] = new_masks
        per_request = step.rows_per_request or [1] * len(step.sample_seq_ids)
        first_row = dict(zip(step.sample_seq_ids, itertools.accumulate(per_request, initial=0)))
        rows = np.zeros(len(step.sample_rows), np.int32)
        rows[[first_row[s] + i for s, n in zip(grammar.seq_ids, grammar.num_rows) for i in range(n)]] = grammar.mask_rows
        return self.to_device(np.int32, rows)[0]

    def penalties(self, step: StepInputs, s: np.ndarray) -> Penalties | None:
        """Each penalised row's tokens so far. The last one may still be in flight on the host,
        so it is taken from this step's input on the device (it is the row's last input token)."""
        which = np.flatnonzero((s["presence"] != 0) | (s["frequency"] != 0) | (s["repetition"] != 1))
        if not len(which):
            return None
        rows, ends = step.sample_rows[which], step.sample_ends[which]
        cols = np.arange(ends.max())
        token_ids = np.where(cols < (ends - 1)[:, None], self.token_ids[rows, :ends.max()], self.vocab_size)
        token_ids, rows_t, last = self.to_device(np.int64, token_ids, which, ends - 1)
        last_input = step.input_ids[step.logits_indices[rows_t]]
        token_ids[torch.arange(len(which), device=self.device), last] = last_input
        (is_output,) = self.to_device(np.bool_, cols >= self.num_prompt_tokens[rows][:, None])
        presence, frequency, repetition = self.to_device(
            np.float32, s["presence"][which], s["frequency"][which], s["repetition"][which])
        return Penalties(rows_t, token_ids, is_output, presence, frequency, repetition)

    def record_sampled(self, seq_ids: list[int], sampled_token_ids: torch.Tensor) -> None:
        """Keep a step's samples on the device: the next step's decodes take their input from them."""
        self.prev_sampled_token_ids = sampled_token_ids[:, -1]
        self.prev_sample_index = {seq_id: row for row, seq_id in enumerate(seq_ids)}
