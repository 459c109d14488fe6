"""The engine core: the scheduler and the model, stepping, with token ids in and out.

vLLM V1 splits an engine in two. The core owns what runs next to the GPU: the scheduler (which
sequences run this step, and their KV-cache blocks), the model executor, and the grammars of
structured output. It knows a request as sequences of token ids (`EngineCoreRequest`), and each
step returns, for every sequence it touched, the new token ids (`EngineCoreOutput`). The front
end does the rest: tokenizing and validating prompts, detokenizing, stop strings, building
`RequestOutput`s (`LLMEngine` for the offline `LLM`, `AsyncLLM` for a server).

Offline, the front end calls the core in its own process, so the whole engine can be stepped
through in a debugger. A server runs the core in a process of its own (core_client.py), where it
steps in a busy loop while the front end serves HTTP, tokenizes and detokenizes.

`step()`: schedule -> run the model on the flattened batch -> sample -> append the tokens and
apply the token-level stops. With async scheduling (the default) the step's second half is done
one step later: step N+1 is scheduled and launched while step N still runs on the GPU, and only
then does the host wait for step N's tokens and process them. So the GPU never waits for the
host's scheduling and input building, as long as those take less time than a step's kernels.

Pipeline parallelism (P stages) keeps up to P steps in flight, vLLM V1's batch queue: step N+1
enters the first stage while step N is in the second. Their sequences are disjoint: a sequence
with a step in flight is not scheduled again until that step's tokens are back (the scheduler
skips it), and a step holds at most max_num_seqs / P sequences, so that P steps share the running
ones. This replaces async scheduling's overlap (a decode reading the token its previous step is
still sampling, on the device), which would have each sequence wait for its own previous step.
When everything runnable is in flight, a step only waits for the oldest one.
"""
import atexit
import gc
import weakref
from collections import deque

import torch

from nanoinfer.config import Config
from nanoinfer.core.block_manager import BlockManager
from nanoinfer.core.messages import EngineCoreOutput, EngineCoreRequest, SchedulerStats
from nanoinfer.core.scheduler import Scheduler
from nanoinfer.core.sequence import Sequence
from nanoinfer.engine.event_log import EventLog
from nanoinfer.executor.multiproc_executor import MultiprocExecutor
from nanoinfer.kv_transfer import make_kv_connector
from nanoinfer.structured_output import Grammar, StructuredOutputManager
from nanoinfer.worker.model_runner import ModelRunner


# What EngineCore froze is freed at exit (extensions check for leaks).
atexit.register(gc.unfreeze)


class StepsInFlight(deque):
    """The launched steps whose outputs the scheduler has not taken yet, oldest first (vLLM's
    batch queue): async scheduling's one, or one per pipeline stage. Each is a step's output,
    `get_output()` to wait for it."""

    def __init__(self, scheduler: Scheduler, config: Config):
        super().__init__()
        self.scheduler = scheduler
        pp = config.pipeline_parallel_size
        self.max_steps = pp if pp > 1 else int(config.async_scheduling)
        # Pipelined steps in flight hold disjoint sequences.
        self.disjoint = pp > 1

    def finish(self, keep: int) -> list[EngineCoreOutput]:
        """Wait for the oldest steps until `keep` are left; their outputs, processed."""
        outputs = []
        while len(self) > keep:
            outputs += self.scheduler.update_from_output(self.popleft().get_output())
        return outputs

    def finish_for_grammar(self) -> list[EngineCoreOutput]:
        """Before a step's grammar masks, the steps whose tokens its grammars must have seen:
        under async scheduling the one in flight; pipelined, none holds its sequences."""
        return [] if self.disjoint else self.finish(keep=0)


class EngineCore:

    def __init__(self, config: Config, tokenizer=None):
        self.config = config
        one_rank = config.world_size == 1
        # The KV connector: one rank's serves the worker too; with several, each has its own.
        self.kv_connector = make_kv_connector(config, 0 if one_rank else None)
        # The model runs here (one process, one device) or on model-parallel ranks (executor/),
        # which stop with the core, or at interpreter exit.
        if one_rank:
            self.model_executor = ModelRunner(config, self.kv_connector)
        else:
            self.model_executor = MultiprocExecutor(config)
            weakref.finalize(self, self.model_executor.shutdown)
        block_manager = BlockManager(self.model_executor.num_kvcache_blocks, config.block_size,
                                     config.enable_prefix_caching, config.max_model_len)
        self.scheduler = Scheduler(config, block_manager, self.kv_connector)
        self.structured_output = StructuredOutputManager(tokenizer, config.hf_config.vocab_size,
                                                         config.eos_token_ids)
        self.in_flight = StepsInFlight(self.scheduler, config)
        # What the core does, written down (off by default; a server's live page turns it on).
        self.event_log = EventLog(self.scheduler, config.event_log) if config.event_log else None
        if self.event_log is not None:   # (written to its end at exit, if nobody shuts down)
            weakref.finalize(self, self.event_log.close)
        # The last step's tokens (for progress bars), and counts since the start.
        self.num_prefill_tokens = self.num_decode_tokens = 0
        self.num_requests_added = self.num_aborted_seqs = 0
        # The hundreds of thousands of objects start-up made (modules, the tokenizer, parameters)
        # live as long as the engine: take them out of the garbage collector's sight, so that its
        # full collections, which the step loop's allocations trigger now and then, stay short.
        gc.collect()
        gc.freeze()

    def add_request(self, request: EngineCoreRequest) -> None:
        self.num_requests_added += 1
        if self.event_log is not None:
            self.event_log.add(request)
        grammar = request.grammar
        compiled = None if grammar is None else self.structured_output.compile(grammar)
        for seq_id, params in zip(request.seq_ids, request.params):
            seq = Sequence(seq_id, request.prompt_token_ids, params, request.max_tokens,
                           self.config.block_size)
            # Each sample has its own state in the one compiled grammar.
            if compiled is not None:
                seq.grammar = Grammar(compiled)
            self.scheduler.add(seq)

    def abort_requests(self, seq_ids: list[int], reason: str = "abort") -> None:
        """Finish these sequences at once and free their blocks; ids no longer live are ignored.
        `reason`: "abort", or "stop" for those a stop string ended (the front end found it)."""
        for seq_id in seq_ids:
            if seq_id in self.scheduler.requests:
                self.scheduler.finish(self.scheduler.requests[seq_id], reason)
                self.num_aborted_seqs += 1

    def has_unfinished(self) -> bool:
        return bool(self.scheduler.requests or self.in_flight)

    def step(self) -> list[EngineCoreOutput]:
        """Schedule a step and launch it; return the outputs of the steps that are done (the
        scheduler's `update_from_output` has applied them: StepsInFlight.finish)."""
        sched = self.scheduler.schedule()
        # Sequences that ended outside any step: scheduling found their grammar failed to compile.
        outputs = self.scheduler.take_unstepped_outputs()
        self.num_prefill_tokens = sum(n for n in sched.num_scheduled_tokens.values() if n > 1)
        self.num_decode_tokens = sum(1 for n in sched.num_scheduled_tokens.values() if n == 1)
        # Everything runnable is in flight, or nothing is runnable yet.
        if sched.is_empty:
            return outputs + self.wait_for_work()
        executed = self.model_executor.execute_model(sched)
        grammar = None
        # Structured output: the masks of the step's guided sequences, for sampling.
        if self.scheduler.has_guided(sched):
            outputs += self.in_flight.finish_for_grammar()
            grammar = self.structured_output.grammar_bitmask(self.scheduler.guided_samples(sched))
        self.in_flight.append(self.model_executor.sample_tokens(executed, grammar))
        # Async scheduling leaves the step just launched in flight and finishes the one before
        # (a step that only loaded KV blocks is finished at once).
        keep = self.in_flight.max_steps if sched.num_scheduled_tokens else 0
        return outputs + self.in_flight.finish(keep)

    def wait_for_work(self) -> list[EngineCoreOutput]:
        """With nothing to launch: the outputs of the oldest step in flight, or a short wait for
        a grammar to compile."""
        if self.in_flight:
            return self.in_flight.finish(keep=len(self.in_flight) - 1)
        self.structured_output.wait_for_compilation()
        return []

    def stats(self) -> SchedulerStats:
        """The core's load and counts now (reading them changes nothing)."""
        bm = self.scheduler.block_manager
        return SchedulerStats(len(self.scheduler.running), len(self.scheduler.waiting),
                              1 - bm.num_free_blocks / bm.num_blocks, bm.num_prefix_query_tokens,
                              bm.num_prefix_hit_tokens, self.num_requests_added,
                              self.num_aborted_seqs, self.scheduler.num_preemptions,
                              self.kv_connector.stats() if self.kv_connector else {})

    def abort_all(self) -> None:
        """Abort every request. A step cut off half-way may have entered blocks in the prefix
        cache whose keys and values were never computed, so the prefix cache is emptied too."""
        self.structured_output.reset()
        self.in_flight.clear()
        self.abort_requests(list(self.scheduler.requests))
        self.scheduler.block_manager.reset_prefix_cache()
        self.model_executor.reset()

    def watch(self, on: bool) -> None:
        """A server's live viewer came (it gets a snapshot, then every record) or left; without
        a file to write, the core records only meanwhile."""
        self.event_log = (self.event_log or EventLog(self.scheduler)).watch(on)

    def shutdown(self, graceful: bool = True) -> None:
        """Stop the tensor-parallel workers and free the model and its KV cache. Idempotent."""
        self.in_flight.clear()
        if self.event_log is not None:
            self.event_log.close()
        if self.model_executor is None:
            return
        if self.config.world_size > 1:
            self.model_executor.shutdown(graceful)
        self.model_executor = None
        self.structured_output.shutdown()
        if self.kv_connector is not None:
            self.kv_connector.shutdown()
        # Let the collector free the model's reference cycles.
        gc.unfreeze()
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
