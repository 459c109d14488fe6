"""A launched step's output on its way to the host (the model runner's, worker/model_runner.py).

`sample_tokens` returns without waiting for the GPU: the step's sampled tokens (and logprobs,
drafts, prompt logprobs) are copied to pinned host memory by copies queued behind the step's
kernels, and an event is recorded after them. `get_output()` waits for that event alone and
turns the tensors into the plain `ModelRunnerOutput` the scheduler reads. So the host can
schedule and launch the next step while this one still runs (async scheduling).
"""
import itertools

import torch

from nanoinfer.core.messages import LogprobsLists, ModelRunnerOutput
from nanoinfer.layers.sampler import SamplerOutput


def to_host(tensors: list[torch.Tensor | None]) -> tuple[list, torch.cuda.Event | None]:
    """Copies to the host queued behind the step's kernels (a None, an optional output left out,
    stays None; the first must be a tensor), and an event after them (a CUDA tensor's; None on
    the CPU, where the copies are done at once)."""
    copies = [None if t is None else t.to("cpu", non_blocking=True) for t in tensors]
    if not tensors[0].is_cuda:
        return copies, None
    copied = torch.cuda.Event()
    copied.record()
    return copies, copied


class AsyncModelRunnerOutput:
    """A launched step's sampled tokens on their way to the host: `get_output` waits for them."""

    def __init__(self, seq_ids: list[int], sampled: SamplerOutput | None = None,
                 rows_per_request: list[int] | None = None, drafts: torch.Tensor | None = None,
                 kv_loaded: dict[int, int] | None = None, prompt_logprobs: tuple | None = None,
                 kv_saved: tuple | None = None):
        """sampled: a row of tokens per request (padded with -1), and logprobs a row per sample row
        (`rows_per_request` of them per request: its drafts and one; one each by default). The
        optional mechanisms': the next step's drafts; seq_id -> a KV connector's blocks loaded in
        the step, and (its saver, the ticket of the step's saves); the step's prompt tokens'
        logprobs, (the layout, the rows)."""
        self.seq_ids = seq_ids
        self.sampled = None
        self.copied = None
        self.rows_per_request = rows_per_request
        self.kv_loaded = kv_loaded
        self.kv_saved = kv_saved
        self.prompt_logprobs = prompt_logprobs
        self.drafts = None if drafts is None else drafts.to("cpu", non_blocking=True)
        # Copies queued behind the step's kernels: the host goes on meanwhile.
        if sampled is not None:
            copies, self.copied = to_host([sampled.sampled_token_ids, sampled.logprob_token_ids,
                                           sampled.logprobs, sampled.sampled_token_ranks])
            self.sampled = SamplerOutput(*copies)

    def get_output(self) -> ModelRunnerOutput:
        # A KV connector's producer reports a step once its blocks are saved.
        if self.kv_saved is not None:
            saver, ticket = self.kv_saved
            saver.wait(ticket)
        if self.sampled is None:
            return ModelRunnerOutput(kv_loaded=self.kv_loaded, prompt_logprobs=self.prompt_rows())
        if self.copied is not None:
            self.copied.synchronize()
        token_ids = self.sampled.sampled_token_ids.tolist()
        if self.rows_per_request is not None:   # (verified drafts: rows padded with -1)
            token_ids = [[t for t in row if t >= 0] for row in token_ids]
        out = ModelRunnerOutput(
            self.seq_ids, token_ids, kv_loaded=self.kv_loaded, prompt_logprobs=self.prompt_rows(),
            spec_token_ids=None if self.drafts is None else self.drafts.tolist())
        # A request's emitted tokens' logprobs are those of its first sample rows.
        if self.sampled.logprobs is not None:
            per_request = self.rows_per_request or [1] * len(self.seq_ids)
            starts = itertools.accumulate(per_request, initial=0)
            rows = [start + j for start, new in zip(starts, token_ids) for j in range(len(new))]
            s = self.sampled
            out.logprobs = LogprobsLists(*([t[r] for r in rows] for t in (
                s.logprob_token_ids.tolist(), s.logprobs.tolist(), s.sampled_token_ranks.tolist())))
        return out

    def prompt_rows(self) -> dict | None:
        """seq_id -> (position of its first token scored, LogprobsLists of its tokens)."""
        if self.prompt_logprobs is None or self.prompt_logprobs[1] is None:
            return None
        layout, (rows, copied) = self.prompt_logprobs
        if copied is not None:
            copied.synchronize()
        ids, logprobs, ranks = (t.tolist() for t in rows)
        starts = itertools.accumulate([n for _, _, n in layout], initial=0)
        return {seq_id: (first, LogprobsLists(ids[k:k + n], logprobs[k:k + n], ranks[k:k + n]))
                for (seq_id, first, n), k in zip(layout, starts)}
