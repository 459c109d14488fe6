"""Part 2 of the prefix-caching study (docs/prefix_study.py): the order of admission.

The stream is sent as a live service sends it: a request that carries an earlier one's output
(`Request.after`: a chat's next turn, an agent's next step, a thought taken further) comes when
that one has finished; the others are all there from the start.
Each step admits waiting requests in order until one does not fit: all 32 places taken
(`MAX_RUNNING`), its uncached prompt tokens past what is left of the step's 4,096 (`STEP_BUDGET`,
less one token for each running request's decode), or no room in the cache for all it will
compute (a request reserves its whole length, so nothing is ever preempted). Then every running
request makes one token; one that has made all its output finishes and leaves.

The order is first-come-first-served, or longest-cached-prefix-first (SGLang's cache-aware
order): the waiting requests sorted by `cached_len`, the tokens each finds cached now. Both are
made again only when a request has come or gone, since nothing else changes them.
"""
import statistics
from collections import Counter, defaultdict
from typing import NamedTuple

from prefix_streams import Request

STEP_BUDGET = 4096
MAX_RUNNING = 32


class Admission(NamedTuple):
    hit_rate: float          # of the stream's prompt tokens, served from the cache
    computed: int            # prompt tokens computed
    longest_wait: int        # steps from coming to admission
    median_wait: float
    mean_running: float      # requests running in a step, on average
    steps: int               # to finish the stream
    stopped_by_memory: int   # steps whose admissions stopped for want of room in the cache
    stopped_by_budget: int   # and for want of tokens in the step's budget


def admit_some(cache, stream: list[Request], order: list[int], running: dict[int, int]
               ) -> tuple[list[tuple[int, int]], str | None]:
    """Admit requests in `order` while they fit: each admitted with the tokens it found cached,
    and what stopped the admissions ("requests", "budget", "memory"; None: nobody was left)."""
    budget = STEP_BUDGET - len(running)
    admitted = []
    for i in order:
        req = stream[i]
        if len(running) == MAX_RUNNING:
            return admitted, "requests"
        match, hit = cache.match(i, req)
        # (a prompt larger than the budget runs in a step of its own)
        if running and len(req.prompt) - hit > budget:
            return admitted, "budget"
        if not cache.admit(i, req, match):
            return admitted, "memory"
        running[i] = len(req.output)
        budget -= len(req.prompt) - hit
        admitted.append((i, hit))
    return admitted, None


def decode_step(cache, stream: list[Request], running: dict[int, int]) -> list[int]:
    """One token for each running request; those that made their last one finish. Returns them."""
    finished = []
    for i in list(running):
        running[i] -= 1
        if running[i] == 0:
            del running[i]
            cache.decode(i, stream[i])
            cache.finish(i, stream[i])
            finished.append(i)
    return finished


def admission(cache, stream: list[Request], cache_aware: bool) -> Admission:
    followers = defaultdict(list)
    for i, req in enumerate(stream):
        if req.after is not None:
            followers[req.after].append(i)
    waiting = [i for i, req in enumerate(stream) if req.after is None]
    arrived = dict.fromkeys(waiting, 0)
    running = {}   # request -> the tokens it has still to make
    hits = 0
    num_running = 0   # summed over the steps
    waits = []
    stops = Counter()
    order = []
    changed = True
    step = 0
    while waiting or running:
        if changed:
            order = sorted(waiting, key=lambda i: -cache.cached_len(i, stream[i])) \
                if cache_aware else list(waiting)
        admitted, stop = admit_some(cache, stream, order, running)
        stops[stop] += 1
        for i, hit in admitted:
            waiting.remove(i)
            hits += hit
            waits.append(step - arrived[i])
        num_running += len(running)
        step += 1
        finished = decode_step(cache, stream, running)
        for i in finished:
            waiting += followers[i]
            arrived.update(dict.fromkeys(followers[i], step))
        changed = bool(admitted or finished)
    prompt_tokens = sum(len(r.prompt) for r in stream)
    return Admission(hits / prompt_tokens, prompt_tokens - hits, max(waits),
                     statistics.median(waits), num_running / step, step, stops["memory"],
                     stops["budget"])
