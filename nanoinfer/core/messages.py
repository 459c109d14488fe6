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
    seq_id: int
    # every known token: the prompt, and the output so far when resumed
    token_ids: list[int]
    num_prompt_tokens: int
    sampling_params: SamplingParams
    block_ids: list[int]
    num_computed_tokens: int      # before this step: the prefix found in the cache


@dataclass
class CachedRequestData:
    """The requests the runner already holds, one column per field."""
    seq_ids: list[int] = field(default_factory=list)
    new_token_ids: list[list[int]] = field(default_factory=list)   # known since it was last sent
    new_block_ids: list[list[int]] = field(default_factory=list)   # appended to its block table
    num_computed_tokens: list[int] = field(default_factory=list)   # before this step


@dataclass
class SchedulerOutput:
    scheduled_new_reqs: list[NewRequestData] = field(default_factory=list)
    scheduled_cached_reqs: CachedRequestData = field(default_factory=CachedRequestData)
    # seq_id -> tokens; step order
    num_scheduled_tokens: dict[int, int] = field(default_factory=dict)
    # finished or aborted since the last step
    finished_seq_ids: set[int] = field(default_factory=set)
    preempted_seq_ids: set[int] = field(default_factory=set)   # preempted by this step
    # seq_id -> the draft tokens scored after its known tokens (speculative decoding)
    scheduled_spec_decode_tokens: dict[int, list[int]] = field(default_factory=dict)
    # a KV connector's (kv_transfer/): seq_id -> the (block id, hash) blocks to fill before the forward,
    # and the (block id, hash) full prompt blocks this step computes, to save after it
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
    first, then the top N (N = the most any row asked)."""
    logprob_token_ids: list[list[int]]
    logprobs: list[list[float]]
    # the sampled token's rank in the whole vocabulary (1 = the top)
    sampled_token_ranks: list[int]


@dataclass
class ModelRunnerOutput:
    seq_ids: list[int] = field(default_factory=list)                   # the sampled requests
    # each one's new tokens, in order
    sampled_token_ids: list[list[int]] = field(default_factory=list)
    logprobs: LogprobsLists | None = None
    spec_token_ids: list[list[int]] | None = None   # each one's drafts for the next step
    kv_loaded: dict[int, int] | None = None   # seq_id -> how many of its kv_loads blocks are good
    # seq_id -> (position of the first prompt token scored, the logprobs of those prompt tokens)
    prompt_logprobs: dict[int, tuple[int, LogprobsLists]] | None = None


@dataclass
class GrammarOutput:
    """The masks of a step's constrained requests: for their sample rows, in the order of
    `seq_ids` (a request with k drafts has k + 1 rows), rows of the device's mask table."""
    seq_ids: list[int]
    num_rows: list[int]
    mask_rows: list[int]   # [sum(num_rows)]
    new_rows: list[int]    # rows to write into the table first ...
    new_masks: np.ndarray | None   # ... with these masks: int32 [len(new_rows), ceil(vocab / 32)]


@dataclass(slots=True)
class EngineCoreOutput:
    """What one step did to one sequence: its new tokens, and how it ended if it did."""
    seq_id: int
    new_token_ids: list[int]
    new_logprobs: list[tuple[list[int], list[float], int]] | None   # per token: ids, logprobs, rank
    num_cached_tokens: int
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    num_draft_tokens: int = 0      # drafts this step scored for it
    num_accepted_tokens: int = 0   # of which the target accepted
    # with its first tokens: the prompt's logprobs (if asked for) and when it was first scheduled
    prompt_logprobs: list[tuple[list[int], list[float], int] | None] | None = None
    scheduled_time: float | None = None


@dataclass
class EngineCoreRequest:
    """A validated request, as the core runs it: one sequence per sample (n of them)."""
    request_id: str
    seq_ids: list[int]
    prompt_token_ids: list[int]
    params: list[SamplingParams]   # per sample (their seeds differ)
    max_tokens: int
    grammar: str | None = None     # the regex of a guided request (structured_output/)


@dataclass
class SchedulerStats:
    """The core's load and cache, for a server's metrics and its load balancer."""
    num_running: int = 0
    num_waiting: int = 0
    kv_cache_usage: float = 0.0   # of the blocks, the fraction in use
    prefix_cache_queries: int = 0   # prompt tokens looked up in the prefix cache, in all
    prefix_cache_hits: int = 0      # ... and found there
    num_requests_added: int = 0     # requests received, in all
    num_aborted_seqs: int = 0       # sequences ended early: aborted, or by a stop string, in all
    num_preemptions: int = 0        # in all
    num_step_tokens: int = 0        # tokens the steps since the last stats computed
    kv_connector: dict = field(default_factory=dict)   # its counts (kv_transfer/), by name
