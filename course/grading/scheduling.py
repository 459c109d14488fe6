"""What assignments 2 and 3 share: schedulers built on a tiny model's config, requests, a
stand-in model whose next token is a fixed function of the tokens before it, and the loop that
drives a scheduler through a workload with it."""
import functools
import itertools
import random
from collections import deque

from nanoinfer import SamplingParams
from nanoinfer.config import Config
from nanoinfer.core.block_manager import BlockManager
from nanoinfer.core.messages import ModelRunnerOutput, SchedulerOutput
from nanoinfer.core.scheduler import Scheduler
from nanoinfer.core.sequence import Sequence

BS = 4            # block size of the schedulers built here
MAX_STEPS = 3000  # a workload that takes longer has stopped making progress
seq_ids = itertools.count()


@functools.cache
def config_of(model_dir: str, budget: int, max_seqs: int) -> Config:
    return Config(model_dir, device="cpu", block_size=BS, max_num_batched_tokens=budget,
                  max_num_seqs=max_seqs)


def scheduler_of(model_dir: str, budget: int = 64, max_seqs: int = 8, num_blocks: int = 256,
                 prefix_caching: bool = True) -> Scheduler:
    config = config_of(model_dir, budget, max_seqs)
    return Scheduler(config, BlockManager(num_blocks, BS, prefix_caching, config.max_model_len))


def request(token_ids, max_tokens: int) -> Sequence:
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    return Sequence(next(seq_ids), list(token_ids), params, max_tokens=max_tokens, block_size=BS)


def tokens(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 500) for _ in range(n)]


def next_token(token_ids: list[int]) -> int:
    """The stand-in model: the next token is a fixed function of all the tokens before it."""
    return 3 + (31 * sum(token_ids) + len(token_ids)) % 500


def sample(scheduler: Scheduler, out: SchedulerOutput) -> list[int]:
    """The runner's half of a step: each scheduled sequence whose step reaches the end of its
    known tokens samples one token, which the scheduler takes. Returns their ids."""
    seqs = [scheduler.requests[seq_id] for seq_id in out.num_scheduled_tokens]
    sampled = [seq for seq in seqs if seq.num_computed_tokens >= seq.num_tokens]
    scheduler.update_from_output(ModelRunnerOutput(
        seq_ids=[seq.seq_id for seq in sampled],
        sampled_token_ids=[[next_token(seq.token_ids)] for seq in sampled]))
    return [seq.seq_id for seq in sampled]


def run_workload(scheduler: Scheduler, workload, on_step) -> list[Sequence]:
    """Step until every request of `workload` (each: the step it arrives before, prompt length,
    max_tokens) is done; `on_step(out, arrived)` sees each step's message before the runner's
    half, and the requests added just before it."""
    pending, seqs = deque(sorted(workload, key=lambda r: r[0])), []
    for step in range(MAX_STEPS):
        arrived = []
        while pending and pending[0][0] <= step:
            _, prompt_len, max_tokens = pending.popleft()
            arrived.append(request(tokens(prompt_len, seed=len(seqs) + len(arrived)), max_tokens))
            scheduler.add(arrived[-1])
        seqs += arrived
        if not pending and not scheduler.requests:
            return seqs
        out = scheduler.schedule()
        on_step(out, arrived)
        sample(scheduler, out)
    raise AssertionError(f"the requests were not done after {MAX_STEPS} steps")
