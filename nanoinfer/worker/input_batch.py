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
so the step can replay a decode CUDA graph. Each row reads its sequence's keys again (k + 1 times
in all, against once for the multi-query kernel), which the graph's saved launches pay for only
while a decode graph can run the step: larger steps, and eager engines, are not flattened (a
prefill graph takes the larger ones of up to 16 sequences).
"""
import itertools
from dataclasses import dataclass

import numpy as np
import torch

from nanoinfer.attention import AttentionMetadata
from nanoinfer.config import Config
from nanoinfer.core.messages import NewRequestData, SchedulerOutput
from nanoinfer.utils import cdiv
from nanoinfer.worker.sampling_inputs import SAMPLING_FIELDS, SamplingInputs

def append_rows(table: np.ndarray, counts: np.ndarray, rows: np.ndarray,
                values: list[list[int]]) -> None:
    """Append values[i] to row rows[i] of `table`, after its counts[rows[i]] entries
    (vectorised)."""
    lens = np.fromiter(map(len, values), np.int64, len(values))
    if not lens.any():
        return
    which = np.repeat(rows, lens)
    offsets = np.arange(len(which)) - np.repeat(np.cumsum(lens) - lens, lens)
    table[which, counts[which] + offsets] = list(itertools.chain.from_iterable(values))
    counts[rows] += lens


def draft_rows(per_row: np.ndarray, logits_indices: np.ndarray, sample_rows: np.ndarray,
               sample_ends: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Each sampling request's one row repeated for its drafts and one more (`per_row`): its
    last `per_row` positions, each sampling the token after it."""
    j = np.arange(per_row.sum()) - np.repeat(np.cumsum(per_row) - per_row, per_row)
    return (np.repeat(logits_indices + 1 - per_row, per_row) + j, np.repeat(sample_rows, per_row),
            np.repeat(sample_ends + 1 - per_row, per_row) + j)


@dataclass
class StepInputs:
    """A step as one flat batch. `input_ids` and `positions`: int64 [tokens]. `logits_indices`:
    int64 [sample rows], the positions whose logits are sampled. `sample_seq_ids`: the requests
    that sample, in row order. Per sample row, `sample_rows` is the request's row in the
    persistent batch and `sample_ends` the position of the token it samples.

    The optional mechanisms': with drafts, `draft_token_ids` (int64 [sampling requests, k],
    padded with -1), `num_drafts` (int64 [sampling requests]) and `rows_per_request` (its drafts
    and one); for EAGLE, per scheduled request its last position (flat index, `last_rows`) and
    the known token after it (0 if none, `next_token_ids`), and the sampling requests' block
    tables with the lookahead's blocks; for prompt logprobs, the requests that want them
    [(seq_id, position of the first token scored, tokens scored)], the flat positions before
    those tokens, the tokens, and the most top-N asked."""
    input_ids: torch.Tensor
    positions: torch.Tensor
    attn_metadata: AttentionMetadata
    logits_indices: torch.Tensor
    sample_seq_ids: list[int]
    sample_rows: np.ndarray
    sample_ends: np.ndarray
    draft_token_ids: torch.Tensor | None = None
    num_drafts: torch.Tensor | None = None
    rows_per_request: list[int] | None = None
    last_rows: torch.Tensor | None = None
    next_token_ids: torch.Tensor | None = None
    sample_block_tables: torch.Tensor | None = None
    prompt_logprobs: tuple[list, torch.Tensor, torch.Tensor, int] | None = None


class InputBatch(SamplingInputs):

    def __init__(self, config: Config, device: torch.device):
        self.block_size = config.block_size
        self.eos_token_ids = config.eos_token_ids
        self.vocab_size = config.hf_config.vocab_size
        # Positions past a step that EAGLE writes; the size up to which a step that only verifies
        # drafts runs as decode rows.
        self.lookahead = config.num_lookahead_tokens
        self.max_flat_rows = 0
        self.device = device
        max_num_reqs = config.max_num_seqs
        max_model_len = config.max_model_len
        # pages of the token table are touched only as they are used
        self.token_ids = np.zeros((max_num_reqs, max_model_len), np.int32)
        self.num_tokens = np.zeros(max_num_reqs, np.int64)
        self.num_prompt_tokens = np.zeros(max_num_reqs, np.int64)
        self.num_computed_tokens = np.zeros(max_num_reqs, np.int64)
        self.block_table = np.zeros((max_num_reqs, cdiv(max_model_len, self.block_size)), np.int32)
        self.num_blocks = np.zeros(max_num_reqs, np.int64)
        self.sampling = np.zeros(max_num_reqs, SAMPLING_FIELDS)
        # the tokens blocked before min_tokens, and the logit biases, per row
        self.stop_ids: list[list[int]] = [[] for _ in range(max_num_reqs)]
        self.logit_bias: list[dict[int, float]] = [{} for _ in range(max_num_reqs)]
        # The seeds of unseeded requests' draws.
        self.rng = np.random.default_rng(config.seed)
        # the structured-output masks (row 0: every token allowed)
        self.grammar_masks: torch.Tensor | None = None
        self.clear()

    def clear(self) -> None:
        self.rows: dict[int, int] = {}   # (seq_id -> row)
        self.free_rows = list(range(len(self.num_tokens) - 1, -1, -1))
        # the last step's samples, on the device, and seq_id -> its row in them
        self.prev_sampled_token_ids: torch.Tensor | None = None
        self.prev_sample_index: dict[int, int] = {}

    def update(self, sched: SchedulerOutput) -> None:
        for seq_id in sched.finished_seq_ids | sched.preempted_seq_ids:
            row = self.rows.pop(seq_id, None)
            if row is not None:
                self.free_rows.append(row)
        for req in sched.scheduled_new_reqs:
            self.add_request(req)
        cached = sched.scheduled_cached_reqs
        rows = np.array([self.rows[s] for s in cached.seq_ids], np.int64)
        append_rows(self.token_ids, self.num_tokens, rows, cached.new_token_ids)
        append_rows(self.block_table, self.num_blocks, rows, cached.new_block_ids)
        self.num_computed_tokens[rows] = cached.num_computed_tokens
        # Drafts are written after the known tokens, without being counted.
        for seq_id, drafts in sched.scheduled_spec_decode_tokens.items():
            row = self.rows[seq_id]
            self.token_ids[row, self.num_tokens[row]:self.num_tokens[row] + len(drafts)] = drafts

    def add_request(self, req: NewRequestData) -> None:
        row = self.rows[req.seq_id] = self.free_rows.pop()
        self.token_ids[row, :len(req.token_ids)] = req.token_ids
        self.num_tokens[row] = len(req.token_ids)
        self.num_prompt_tokens[row] = req.num_prompt_tokens
        self.num_computed_tokens[row] = req.num_computed_tokens
        self.block_table[row, :len(req.block_ids)] = req.block_ids
        self.num_blocks[row] = len(req.block_ids)
        self.set_sampling(row, req.sampling_params)

    def to_device(self, dtype: type, *arrays) -> list[torch.Tensor]:
        """Host arrays as device tensors of one dtype, in one copy: packed into one buffer (through
        numpy: torch.tensor(list) costs about a microsecond per element), pinned, copied without
        blocking, and cut into views."""
        flat = [np.asarray(a, dtype=dtype).reshape(-1) for a in arrays]
        # A copy: never a view of the batch's arrays, which the next step changes.
        buffer = torch.from_numpy(np.concatenate(flat))
        if self.device.type != "cpu":
            buffer = buffer.pin_memory().to(self.device, non_blocking=True)
        return [v.view(np.shape(a)) for v, a in zip(buffer.split([f.size for f in flat]), arrays)]

    def prepare_inputs(self, sched: SchedulerOutput) -> StepInputs:
        """The step as one flat batch: every scheduled request's new tokens back to back."""
        bs = self.block_size
        seq_ids = list(sched.num_scheduled_tokens)
        rows = np.fromiter((self.rows[s] for s in seq_ids), np.int64, len(seq_ids))
        num_new = np.fromiter(sched.num_scheduled_tokens.values(), np.int64, len(seq_ids))
        start = self.num_computed_tokens[rows]
        end = start + num_new
        cu_seqlens_q = np.concatenate([[0], np.cumsum(num_new)])
        token_rows = np.repeat(rows, num_new)
        positions = np.arange(cu_seqlens_q[-1]) + np.repeat(start - cu_seqlens_q[:-1], num_new)
        slots = self.block_table[token_rows, positions // bs].astype(np.int64) * bs + positions % bs
        # a request samples when its step reaches its last token (known, or in flight)
        sample = end >= self.num_tokens[rows]
        sample_seq_ids = [s for s, x in zip(seq_ids, sample) if x]
        # (the index of each sampling request's last token; its row; where its step ends)
        logits_indices = cu_seqlens_q[1:][sample] - 1
        sample_rows = rows[sample]
        sample_ends = end[sample]
        num_drafts = self.num_drafts(sched, seq_ids)
        # A request with k drafts samples at its last k + 1 positions.
        if num_drafts is not None:
            logits_indices, sample_rows, sample_ends = draft_rows(
                num_drafts[sample] + 1, logits_indices, sample_rows, sample_ends)
        in_flight, prev_index = self.inputs_in_flight(seq_ids, token_rows, positions,
                                                      cu_seqlens_q, num_new, num_drafts)
        # (on the device: one copy of them all; the names ending in _t are its tensors)
        input_ids, positions_t, slots_t, logits_indices_t, in_flight_t, prev_index_t = \
            self.to_device(np.int64, self.token_ids[token_rows, positions], positions, slots,
                           logits_indices, in_flight, prev_index)
        # An input that the previous step is still sampling comes from its output, on the device.
        if len(in_flight):
            input_ids[in_flight_t] = self.prev_sampled_token_ids[prev_index_t]
        meta = self.attention_metadata(num_new, end, rows, positions, token_rows, slots_t,
                                       num_drafts)
        step = StepInputs(input_ids, positions_t, meta, logits_indices_t, sample_seq_ids,
                          sample_rows, sample_ends)
        if num_drafts is not None:
            self.draft_inputs(step, sched, num_drafts[sample])
        if self.lookahead:
            self.eagle_inputs(step, rows, end, cu_seqlens_q, sample)
        step.prompt_logprobs = self.prompt_positions(seq_ids, rows, start, end, cu_seqlens_q)
        return step

    def attention_metadata(self, num_new: np.ndarray, end: np.ndarray, rows: np.ndarray,
                           positions: np.ndarray, token_rows: np.ndarray,
                           slot_mapping: torch.Tensor, num_drafts: np.ndarray | None
                           ) -> AttentionMetadata:
        """Per request its query count, key count and block table. A
        step that only verifies drafts and that a decode CUDA graph can run is laid out as one:
        a row per token, each a single query over its own causal prefix."""
        q_lens, kv_lens, table_rows = num_new, end, rows
        if num_drafts is not None and num_new.max() <= num_drafts.max() + 1 \
                and len(positions) <= self.max_flat_rows:
            q_lens, kv_lens, table_rows = np.ones_like(positions), positions + 1, token_rows
        cu_q, context_lens, block_tables = self.to_device(
            np.int32, np.concatenate([[0], np.cumsum(q_lens)]), kv_lens,
            self.block_table[table_rows, :cdiv(end.max(), self.block_size)])
        return AttentionMetadata(cu_seqlens_q=cu_q, context_lens=context_lens,
                                 slot_mapping=slot_mapping, block_tables=block_tables,
                                 max_seqlen_q=int(q_lens.max()))

    def inputs_in_flight(self, seq_ids: list[int], token_rows: np.ndarray,
                         positions: np.ndarray, cu_seqlens_q: np.ndarray, num_new: np.ndarray,
                         num_drafts: np.ndarray | None) -> tuple[np.ndarray, list[int]]:
        """The step's inputs not known here, which the previous step is still sampling (async
        scheduling): their flat indices, and their rows in that step's output."""
        known = self.num_tokens[token_rows]
        if num_drafts is not None:   # (drafts are written after the known tokens)
            known = known + np.repeat(num_drafts, num_new)
        in_flight = np.flatnonzero(positions >= known)
        owners = np.searchsorted(cu_seqlens_q, in_flight, side="right") - 1
        return in_flight, [self.prev_sample_index[seq_ids[i]] for i in owners]

    @staticmethod
    def num_drafts(sched: SchedulerOutput, seq_ids: list[int]) -> np.ndarray | None:
        """Each scheduled request's drafts (None: a step without any)."""
        spec = sched.scheduled_spec_decode_tokens
        if not spec:
            return None
        return np.fromiter((len(spec.get(s, ())) for s in seq_ids), np.int64, len(seq_ids))

    def draft_inputs(self, step: StepInputs, sched: SchedulerOutput, num_drafts: np.ndarray
                     ) -> None:
        """The sampling requests' drafts (speculative decoding), padded with -1."""
        drafts = [sched.scheduled_spec_decode_tokens.get(s, []) for s in step.sample_seq_ids]
        width = max(map(len, drafts))
        padded = np.array([d + [-1] * (width - len(d)) for d in drafts], np.int64)
        step.draft_token_ids, step.num_drafts = self.to_device(np.int64, padded, num_drafts)
        step.rows_per_request = (num_drafts + 1).tolist()

    def eagle_inputs(self, step: StepInputs, rows: np.ndarray, end: np.ndarray,
                     cu_seqlens_q: np.ndarray, sample: np.ndarray) -> None:
        """EAGLE's: each request's last position and the known token after it (0 if none), and
        the sampling requests' block tables with the lookahead's blocks."""
        after = np.minimum(end, self.token_ids.shape[1] - 1)
        next_ids = np.where(end < self.num_tokens[rows], self.token_ids[rows, after], 0)
        step.last_rows, step.next_token_ids = self.to_device(np.int64, cu_seqlens_q[1:] - 1,
                                                             next_ids)
        # (the slice below stops at the table's last column)
        width = cdiv(int(end.max()) + self.lookahead, self.block_size)
        (step.sample_block_tables,) = self.to_device(np.int32,
                                                     self.block_table[rows[sample], :width])

    def prompt_positions(self, seq_ids: list[int], rows: np.ndarray, start: np.ndarray,
                         end: np.ndarray, cu_seqlens_q: np.ndarray) -> tuple | None:
        """Where the step's prompt tokens that want logprobs are predicted: the positions of the
        chunk before each (the prompt's last position predicts the output, not a prompt token).
        (layout, flat indices, tokens, the most top-N asked), or None if none wants them."""
        wanted = self.sampling["prompt_logprobs"][rows]   # (-1: not wanted)
        layout = []
        index = []
        targets = []
        for i in np.flatnonzero(wanted >= 0):
            positions = np.arange(start[i], min(end[i], self.num_prompt_tokens[rows[i]] - 1))
            if len(positions):
                layout.append((seq_ids[i], int(start[i]) + 1, len(positions)))
                index.append(cu_seqlens_q[i] + positions - start[i])
                targets.append(self.token_ids[rows[i], positions + 1])
        if not layout:
            return None
        index, targets = self.to_device(np.int64, np.concatenate(index), np.concatenate(targets))
        return layout, index, targets, int(wanted.max())

    def record_sampled(self, seq_ids: list[int], sampled_token_ids: torch.Tensor) -> None:
        """Keep a step's samples on the device: the next step's decodes take their input from
        them."""
        self.prev_sampled_token_ids = sampled_token_ids[:, -1]
        self.prev_sample_index = {seq_id: row for row, seq_id in enumerate(seq_ids)}
