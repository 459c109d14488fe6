"""KV connectors: a request's prompt KV cache from outside the engine, and to it (vLLM V1's split).

Disaggregated serving runs the prefill of a request in one engine (the producer) and its decode
in another (the consumer): the producer computes the prompt's keys and values and hands them over,
the consumer computes only what it was not given. A connector has two sides:

- the scheduler's (engine core, `Scheduler`): how many of a waiting request's full prompt blocks,
  after those in its own prefix cache, can come from outside (`num_matched_blocks`). The
  scheduler then admits the request with blocks for them and no tokens to compute: the step
  message asks the runner to fill those blocks (`SchedulerOutput.kv_loads`), and the request
  waits (WAITING_FOR_REMOTE_KVS) until the step's output says how many of them were filled with
  valid data. It counts those as computed (and enters them in its prefix cache) and computes the
  rest like any prompt. Each step also lists the full prompt blocks it computes, to be saved
  (`SchedulerOutput.kv_saves`);
- the worker's (`ModelRunner`, on every rank): before the forward, fill the blocks to load
  (`load_kv`: a rank stops at the first block whose data is missing or fails its check, and the
  ranks agree on the smallest count); after it, save the blocks to save (`save_kv`).

A block is named by its prefix hash (`Sequence.block_hashes`: equal hashes, equal whole
prefixes), so a consumer finds the KV of any prefix the producer computed, whoever asked for it.
`kv_role` says which sides act: "kv_producer" saves, "kv_consumer" loads, "kv_both" does both.

The connector here is SharedStorageConnector (shared_storage.py: files in a folder both engines
can read); what a point-to-point one (vLLM's P2pNcclConnector) would add, and where it would plug
in: docs/ARCHITECTURE.md section 14. An engine of one rank has one connector object for both
sides; with several ranks, every worker has its own and the engine core one more for the
scheduler's side. A producer saves off the step loop (saver.py): a thread writes a step's blocks
while the next step runs, and the step's output is reported once they are saved, so a request the
producer has answered finds its blocks.

Bytes are only meaningful to an engine that would have computed the same ones (layout.py says
which engines those are); shared storage keeps each layout's blocks in a folder of its own.

What the connector promises under faults (a full disk, a file cut short, another model's blocks):
docs/ARCHITECTURE.md section 14.
"""
from nanoinfer.config import Config
from nanoinfer.kv_transfer.shared_storage import SharedStorageConnector


def make_kv_connector(config: Config, rank: int | None = 0) -> SharedStorageConnector | None:
    """The configured connector (None if none is); `rank` is the worker's, in the world (None:
    the engine core's, for the scheduler's side only, beside workers of their own)."""
    return None if config.kv_transfer is None else SharedStorageConnector(config, rank)
