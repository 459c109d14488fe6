"""The messages of a step between the scheduler and the model runner.

`SchedulerOutput` goes in: what to compute. It holds plain data only (no `Sequence`, no tensor),
so it pickles to a few KB and can be sent to workers in other processes (tensor and pipeline
parallelism). A request is sent whole once, when it is first scheduled (and again when it resumes
after a preemption, which made the runner forget it); after that, only what changed: the tokens
that became known, the blocks appended to its table, and where this step's tokens start. The
runner keeps everything else in its persistent batch (`input_batch.py`).

A step computes positions `[num_computed_tokens, num_computed_tokens + num_scheduled_tokens)` of
each scheduled request, in the order of `num_scheduled_tokens`. The runner samples a request when
its step reaches the end of its known tokens. With async scheduling the input of a decode may be a
token the previous step is still sampling: the message cannot carry it, and the runner takes it
from that step's output on the device.

`ModelRunnerOutput` comes back: for each sampled request, the tokens it produced (one, or with
speculative decoding the accepted drafts and one more), and drafts for its next step when the
runner proposes them (EAGLE, Medusa).

Between the front end and the core: `EngineCoreRequest` goes in (a validated request, token ids
only), and `EngineCoreOutput` comes out, what the core tells the front end of each sequence a
step touched, with `SchedulerStats` (its load, for a server's metrics and load balancing).

`GrammarOutput` goes in with the call to sample, when requests are guided (structured_output/):
made after the execute call, since with async scheduling it needs the tokens of the step before.
The masks themselves stay on the device, one row per grammar state: the message names each
sample row's row in that table, and brings only the rows the table does not hold yet.
"""
from dataclasses import dataclass, field

import numpy as np

from nanoinfer.sampling_params import SamplingParams


@dataclass
class NewRequestData:
    """A request sent whole: when it is first scheduled, and when it resumes after a preemption.
    `token_ids` holds every known token (the prompt, and the output so far when it resumes);
    `num_computed_tokens` is where this step starts (the prefix found in the cache)."""
    seq_id: int
    token_ids: list[int]
    num_prompt_tokens: int
    sampling_params: SamplingParams
    block_ids: list[int]
    num_computed_tokens: int


@dataclass
class CachedRequestData:
    """The requests the runner already holds, one column per field: the tokens that became known
    since each was last sent, the blocks appended to its table, and where this step starts."""
    seq_ids: list[int] = field(default_factory=list)
    new_token_ids: list[list[int]] = field(default_factory=list)
    new_block_ids: list[list[int]] = field(default_factory=list)
    num_computed_tokens: list[int] = field(default_factory=list)


@dataclass
class SchedulerOutput:
    """One step. `num_scheduled_tokens` maps each scheduled sequence to its tokens, in the step's
    order; `finished_seq_ids` (finished or aborted since the last step) and `preempted_seq_ids`
    (preempted by this one) are for the runner to forget. The optional mechanisms':
    `scheduled_spec_decode_tokens`, the drafts scored after each sequence's known tokens
    (speculative decoding); `kv_loads`, seq_id -> the (block id, hash) blocks a KV connector fills
    before the forward, and `kv_saves`, the (block id, hash) full prompt blocks this step computes,
    to save after it (kv_transfer/)."""
    scheduled_new_reqs: list[NewRequestData] = field(default_factory=list)
    scheduled_cached_reqs: CachedRequestData = field(default_factory=CachedRequestData)
    num_scheduled_tokens: dict[int, int] = field(default_factory=dict)
    finished_seq_ids: set[int] = field(default_factory=set)
    preempted_seq_ids: set[int] = field(default_factory=set)
    scheduled_spec_decode_tokens: dict[int, list[int]] = field(default_factory=dict)
    kv_loads: dict[int, list[tuple[int, int]]] = field(default_factory=dict)
    kv_saves: list[tuple[int, int]] = field(default_factory=list)

    @property
    def total_num_scheduled_tokens(self) -> int:
        return sum(self.num_scheduled_tokens.values())

    @property
    def is_empty(self) -> bool:
        """Nothing to compute and no KV blocks to load: no step to run."""
        return not self.num_scheduled_tokens and not self.kv_loads


@dataclass
class LogprobsLists:
    """One row per produced token, in the order of the requests and their tokens: the token itself
    first, then the top N (N = the most any row asked), and the sampled token's rank in the whole
    vocabulary (1 = the top)."""
    logprob_token_ids: list[list[int]]
    logprobs: list[list[float]]
    sampled_token_ranks: list[int]


@dataclass
class ModelRunnerOutput:
    """A step's result: the requests that sampled and each one's new tokens, in order; the
    optional mechanisms': each one's drafts for the next step (EAGLE, Medusa), seq_id -> how many
    of its `kv_loads` blocks are good (kv_transfer/), and seq_id -> (the position of the first
    prompt token scored, the logprobs of those prompt tokens)."""
    seq_ids: list[int] = field(default_factory=list)
    sampled_token_ids: list[list[int]] = field(default_factory=list)
    logprobs: LogprobsLists | None = None
    spec_token_ids: list[list[int]] | None = None
    kv_loaded: dict[int, int] | None = None
    prompt_logprobs: dict[int, tuple[int, LogprobsLists]] | None = None


@dataclass
class GrammarOutput:
    """The masks of a step's constrained requests: for their sample rows, in the order of
    `seq_ids` (a request with k drafts has k + 1 rows), rows of the device's mask table
    (`mask_rows`, sum(num_rows) of them). `new_rows` are rows to write into the table first, with
    `new_masks`: int32 [len(new_rows), ceil(vocab / 32)]."""
    seq_ids: list[int]
    num_rows: list[int]
    mask_rows: list[int]
    new_rows: list[int]
    new_masks: np.ndarray | None


@dataclass(slots=True)
class EngineCoreOutput:
    """What one step did to one sequence: its new tokens (and per token, with logprobs, the ids,
    logprobs and rank), and how it ended if it did. With speculative decoding, the drafts the step
    scored for it and how many the target accepted. With its first tokens: the prompt's logprobs
    (if asked for) and when it was first scheduled."""
    seq_id: int
    new_token_ids: list[int]
    num_cached_tokens: int
    new_logprobs: list[tuple[list[int], list[float], int]] | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    prompt_logprobs: list[tuple[list[int], list[float], int] | None] | None = None
    scheduled_time: float | None = None


@dataclass
class EngineCoreRequest:
    """A validated request, as the core runs it: one sequence per sample (n of them), each with
    its own SamplingParams (their seeds differ); a guided request's regex (structured_output/)."""
    request_id: str
    seq_ids: list[int]
    prompt_token_ids: list[int]
    params: list[SamplingParams]
    max_tokens: int
    grammar: str | None = None


@dataclass
class SchedulerStats:
    """The core's load and cache, for a server's metrics and its load balancer: the fraction of
    blocks in use; counts since the start (prompt tokens looked up in the prefix cache and found
    there, requests received, sequences ended early by an abort or a stop string, preemptions);
    a KV connector's counts, by name. (A step's tokens are counted by the front end, from its
    outputs: engine/output_processor.py's IterationStats.)"""
    num_running: int = 0
    num_waiting: int = 0
    kv_cache_usage: float = 0.0
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    num_requests_added: int = 0
    num_aborted_seqs: int = 0
    num_preemptions: int = 0
    kv_connector: dict = field(default_factory=dict)
