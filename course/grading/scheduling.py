"""What assignments 2 and 3 share: schedulers built on a tiny model's config, requests, and a
stand-in model whose next token is a fixed function of the tokens before it."""
import functools
import itertools
import random

from nanoinfer import SamplingParams
from nanoinfer.config import Config
from nanoinfer.core.block_manager import BlockManager
from nanoinfer.core.scheduler import Scheduler
from nanoinfer.core.sequence import Sequence

BS = 4            # block size of the schedulers built here
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
