"""Prefix caching, measured: the engine's hashed blocks against a radix tree, on the same streams.

    python docs/prefix_study.py            # the study (its run time: docs/BENCHMARKS.md)
    python docs/prefix_study.py --plot     # and redraw docs/prefix_study.png (needs matplotlib)
    python docs/prefix_study.py --quick    # small streams, for a check

Two ways to find the keys and values a new request can reuse:

- Hashed blocks, vLLM's and the engine's (`BlockManager`, imported from nanoinfer unchanged and
  driven as core/scheduler.py drives it). The cache is cut into 16-token blocks; a full block is
  known by a hash of its tokens chained to its parent block's, so one dictionary lookup a block
  finds the longest cached run of whole blocks. A freed block keeps its hash until it is reused,
  oldest first. Tokens that match but sit in a block that is not a whole match are computed again.
- A radix tree, SGLang's RadixAttention (docs/radix_cache.py, which says what description of it
  is followed): token by token, so it serves every matching token, for a tree walk and a slot
  index per token.

Both get the same streams (docs/prefix_streams.py, seed 0), the same capacity in tokens and the
same order. "ample" capacity holds every token of the stream, so nothing is evicted; "tight" is
the larger of an eighth of the stream's distinct tokens (what an unbounded tree holds at the end)
and twice its longest request, in whole blocks (the script prints which one decides).

Part 1, a replay: one request at a time is looked up, given room (for its prompt and its output
but the last token: what the engine computes), decoded, entered and released. Only one request
runs at a time, so the reference counts and locks guard only its own matched prefix while room is
made for it: they never keep one request's tokens from another, as they do in part 2. Printed
per stream and capacity: prompt tokens served from the cache and computed, tokens evicted,
metadata bytes per cached token (docs/prefix_caches.py says how they are counted), and host time
per request (medians): hashing the prompt's blocks (blocks only: a new `Sequence` does it), the
lookup, hashing the output's blocks as decoding appends its tokens (blocks only), and the rest
(room, insertion, release). With ample capacity, the tokens lost to
block granularity: after a request's last hit block, those equal to what an earlier request
computed right after the same blocks (a partial block, never cached, or a block that differs
further on); the tree serves exactly the block hits plus those tokens, request by request, and
the study checks that it does. (Where the cache evicts, that count would not be granularity's
alone: the table gives none, "—".) The tight replays are run again for seeds 1 to 3, to tell
which differences between the two caches hold beyond one seed.

Part 2, admission order (tight capacity; docs/prefix_admission.py says how a stream is sent and
admitted): first-come-first-served against longest-cached-prefix-first (SGLang's cache-aware
order). An assumption: sorting looks the waiting requests up without marking their prefixes used
(SGLang's scheduler matches every waiting request again, which refreshes their access times);
only the requests tried for admission are marked. Printed: the hit rate, the waits (steps from
coming to admission: longest and median), the mean number of requests running a step, the steps
to finish, and how many steps' admissions stopped for want of room in the cache or of tokens in
the step's budget. A step counts the same whatever it computes: the hit rate says what is
computed. Part 2 is seed 0's alone.

Part 3 (docs/prefix_engine.py): two streams through `nanoinfer.LLM` itself, whose own counters
must give the figures of this replay's block manager; the script fails if they do not.
"""
import argparse
import os
import statistics
import sys
import time
from dataclasses import dataclass
from typing import NamedTuple

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))   # (the study's other files)
os.environ.setdefault("OMP_NUM_THREADS", "1")   # (two cores, shared: one thread each)

from prefix_admission import Admission, admission  # noqa: E402
from prefix_caches import BLOCK_SIZE, BlockTails, HashedBlocks, RadixTree  # noqa: E402
from prefix_streams import Request, make_streams  # noqa: E402
from radix_cache import RadixCache  # noqa: E402

SEED = 0
MORE_SEEDS = (1, 2, 3)


@dataclass
class Replay:
    prompt_tokens: int
    hits: list[int]   # tokens served from the cache, per request
    evicted_tokens: int
    metadata_bytes_per_token: float
    # Medians per request, µs: hashing the prompt's blocks, the lookup, hashing the output's
    # blocks (those two for blocks only), and entering, freeing and the rest.
    hash_us: float
    lookup_us: float
    output_us: float
    insert_us: float
    lost: list[int] | None   # per request, tokens lost to block granularity (blocks, ample)


class Part1Row(NamedTuple):
    stream: str
    capacity: str   # "ample" or "tight"
    slots: int
    cache: str
    replay: Replay


def replay(cache, stream: list[Request], tails: BlockTails | None = None) -> Replay:
    """Part 1: the requests one at a time through `cache`, timed; with `tails` (blocks, nothing
    evicted), what each loses to block granularity."""
    hits, lost, times = [], [], []
    for i, req in enumerate(stream):
        t0 = time.perf_counter_ns()
        if isinstance(cache, HashedBlocks):
            cache.seq(i, req)
        t1 = time.perf_counter_ns()
        match, hit = cache.match(i, req)
        t2 = time.perf_counter_ns()
        assert cache.admit(i, req, match), "the capacity holds the longest request"
        t3 = time.perf_counter_ns()
        cache.decode(i, req)
        t4 = time.perf_counter_ns()
        cache.finish(i, req)
        t5 = time.perf_counter_ns()
        # (the prompt's hashes, the lookup, the output's hashes, and admitting plus finishing)
        times.append((t1 - t0, t2 - t1, t4 - t3, (t3 - t2) + (t5 - t4)))
        hits.append(hit)
        if tails is not None:
            lost.append(tails.lost(req, cache.seqs[i], hit))
            tails.record(req, cache.seqs[i])
    hash_us, lookup_us, output_us, insert_us = (statistics.median(column) / 1e3
                                                for column in zip(*times))
    return Replay(prompt_tokens=sum(len(r.prompt) for r in stream), hits=hits,
                  evicted_tokens=cache.num_evicted_tokens,
                  metadata_bytes_per_token=cache.metadata_bytes_per_token(),
                  hash_us=hash_us, lookup_us=lookup_us, output_us=output_us,
                  insert_us=insert_us, lost=lost if tails is not None else None)


def block_multiple(n: int) -> int:
    return -(-n // BLOCK_SIZE) * BLOCK_SIZE


def distinct_tokens(stream: list[Request]) -> int:
    """The tokens an unbounded radix tree holds once the whole stream has been computed."""
    tree = RadixCache(sum(len(r.computed) for r in stream))
    for req in stream:
        _, n = tree.match_prefix(req.computed)
        tree.insert(req.computed, tree.alloc(len(req.computed) - n), n)
    return tree.num_cached_tokens


def tight_capacity(stream: list[Request]) -> tuple[int, str]:
    """An eighth of the distinct tokens, but at least twice the longest request (so that two
    fit), in whole blocks; and a line that says which of the two it is."""
    distinct = distinct_tokens(stream)
    longest = max(len(r.computed) for r in stream)
    decides = "an eighth of the distinct" if distinct // 8 >= 2 * longest else "twice the longest"
    return block_multiple(max(distinct // 8, 2 * longest)), \
        f"{distinct:,} distinct tokens, the longest request {longest:,}: {decides}"


def part1(streams: dict[str, list[Request]]) -> tuple[list[Part1Row], dict[str, int]]:
    """Each stream at both capacities through both caches, and each stream's tight slots."""
    rows = []
    tight = {}
    for name, stream in streams.items():
        ample = sum(block_multiple(len(r.computed)) for r in stream)
        blocks = replay(HashedBlocks(ample), stream, BlockTails())
        unbounded = replay(RadixTree(ample), stream)
        assert all(b + lost == t for b, lost, t in zip(blocks.hits, blocks.lost, unbounded.hits)), \
            f"{name}: the tree's hits are not the block hits plus what blocks lose"
        tight[name], rule = tight_capacity(stream)
        print(f"{name}: {len(stream)} requests, {sum(len(r.prompt) for r in stream):,} prompt "
              f"tokens; tight capacity {tight[name]:,} ({rule})")
        rows += [Part1Row(name, "ample", ample, HashedBlocks.name, blocks),
                 Part1Row(name, "ample", ample, RadixTree.name, unbounded)]
        rows += [Part1Row(name, "tight", tight[name], make.name, replay(make(tight[name]), stream))
                 for make in (HashedBlocks, RadixTree)]
    return rows, tight


def served(r: Replay) -> float:
    return 100 * sum(r.hits) / r.prompt_tokens


def print_part1(rows: list[Part1Row]) -> None:
    print("\n| stream | capacity (tokens) | cache | served from cache | computed | evicted "
          "| metadata B/token | hashing µs: prompt / output | lookup µs | insert µs "
          "| lost to blocks |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for row in rows:
        r = row.replay
        hit = sum(r.hits)
        lost = "—" if r.lost is None else f"{sum(r.lost):,}"
        hashing = f"{r.hash_us:.1f} / {r.output_us:.1f}" if row.cache == HashedBlocks.name else ""
        print(f"| {row.stream} | {row.capacity} ({row.slots:,}) | {row.cache} | {hit:,} "
              f"({served(r):.1f}%) | {r.prompt_tokens - hit:,} | {r.evicted_tokens:,} "
              f"| {r.metadata_bytes_per_token:.2f} | {hashing} | {r.lookup_us:.1f} "
              f"| {r.insert_us:.1f} | {lost} |")


def tight_over_seeds(rows: list[Part1Row], quick: bool) -> None:
    """The tight replays' hit rates for seeds 0 (part 1's) to 3: the range, and the tree's lead."""
    rates = {(row.stream, row.cache): [served(row.replay)] for row in rows
             if row.capacity == "tight"}
    for seed in MORE_SEEDS:
        for name, stream in make_streams(seed, quick).items():
            slots, _ = tight_capacity(stream)
            for make in (HashedBlocks, RadixTree):
                rates[name, make.name].append(served(replay(make(slots), stream)))
    seeds = f"{SEED}-{MORE_SEEDS[-1]}"
    print(f"\n| stream | tight, seeds {seeds}: hashed blocks | radix tree "
          "| tree minus blocks (points), seed by seed |")
    print("|---|---|---|---|")
    for name in dict.fromkeys(row.stream for row in rows):
        blocks, tree = rates[name, HashedBlocks.name], rates[name, RadixTree.name]
        lead = " / ".join(f"{t - b:+.1f}" for b, t in zip(blocks, tree))
        print(f"| {name} | {min(blocks):.1f}-{max(blocks):.1f}% | {min(tree):.1f}-{max(tree):.1f}% "
              f"| {lead} |")


class Part2Row(NamedTuple):
    stream: str
    cache: str
    fcfs: Admission
    cache_aware: Admission


def part2(streams: dict[str, list[Request]], tight: dict[str, int]) -> list[Part2Row]:
    rows = [Part2Row(name, make.name, admission(make(tight[name]), stream, False),
                     admission(make(tight[name]), stream, True))
            for name, stream in streams.items() for make in (HashedBlocks, RadixTree)]
    print("\nFirst-come-first-served / cache-aware:\n")
    print("| stream | cache | hit rate | prompt tokens computed "
          "| longest wait | median wait | mean running | steps to finish "
          "| stopped by memory | stopped by budget |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for row in rows:
        a, b = row.fcfs, row.cache_aware
        print(f"| {row.stream} | {row.cache} | {100 * a.hit_rate:.1f}% / {100 * b.hit_rate:.1f}% "
              f"| {a.computed:,} / {b.computed:,} | {a.longest_wait:,} / {b.longest_wait:,} "
              f"| {a.median_wait:,g} / {b.median_wait:,g} "
              f"| {a.mean_running:.1f} / {b.mean_running:.1f} | {a.steps:,} / {b.steps:,} "
              f"| {a.stopped_by_memory:,} / {b.stopped_by_memory:,} "
              f"| {a.stopped_by_budget:,} / {b.stopped_by_budget:,} |")
    return rows


def part3(quick: bool) -> dict[str, Replay]:
    """The engine against the study's block manager, on the same requests; fails if they differ.
    Returns the study's replay of each stream."""
    from prefix_engine import engine_runs
    print("\n| stream | requests | prompt tokens | computed, caching off (engine) "
          "| computed, caching on: engine / study | each request's hits | evicted (study) "
          "| seconds on / off |")
    print("|---|---|---|---|---|---|---|---|")
    studied = {}
    for name, run in engine_runs(SEED, quick).items():
        on = replay(HashedBlocks(run.num_blocks * BLOCK_SIZE), run.stream)
        computed = on.prompt_tokens - sum(on.hits)
        if on.hits != run.cached or run.computed_on != computed:
            raise RuntimeError(f"{name}: the engine's prefix cache found {run.cached}, the "
                               f"study's block manager {on.hits}")
        if run.computed_off != on.prompt_tokens:
            raise RuntimeError(f"{name}: with caching off the engine computed "
                               f"{run.computed_off} of {on.prompt_tokens} prompt tokens")
        print(f"| {name} | {len(run.stream)} | {on.prompt_tokens:,} | {run.computed_off:,} "
              f"| {run.computed_on:,} / {computed:,} | equal | {on.evicted_tokens:,} "
              f"| {run.seconds_on:.1f} / {run.seconds_off:.1f} |")
        studied[name] = on
    return studied


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Prefix caching: hashed blocks against a radix "
                                     "tree (the module's docstring says what is measured).")
    parser.add_argument("--quick", action="store_true", help="small streams, for a check")
    parser.add_argument("--plot", action="store_true",
                        help="redraw docs/prefix_study.png (needs matplotlib)")
    args = parser.parse_args(argv)
    start, cpu_start = time.perf_counter(), time.process_time()
    streams = make_streams(SEED, args.quick)
    rows1, tight = part1(streams)
    print("(with ample capacity the tree's hits are, request by request, the block hits plus the "
          "tokens lost to blocks)")
    print_part1(rows1)
    tight_over_seeds(rows1, args.quick)
    rows2 = part2(streams, tight)
    part3(args.quick)
    if args.plot:
        from prefix_plot import plot
        plot(rows1, rows2, os.path.join(os.path.dirname(os.path.abspath(__file__)),
                                        "prefix_study.png"))
    print(f"\nthe whole study: {time.perf_counter() - start:.0f} s of wall time, "
          f"{time.process_time() - cpu_start:.0f} s of CPU time (this process, imports aside)")


if __name__ == "__main__":
    main()
