"""The engine loop: requests in, one scheduled step at a time, per-request outputs out.

`step()` is the heart of the engine:
    schedule -> run the model on the flattened batch -> sample -> append tokens and check stops
    -> detokenize the new tokens (and check stop strings) -> return each touched request's output.
With async scheduling (the default) the step's second half is done one step later: step N+1 is
scheduled and launched while step N still runs on the GPU, and only then does the host wait for
step N's tokens and process them. So the GPU never waits for the host's scheduling, input
building and detokenizing, as long as those take less time than a step's kernels.

The API is vLLM's and serves both the offline `LLM` and a server's loop: `add_request` and
`abort_request` may be called between steps. A request is validated in `add_request`, so a bad
one is rejected with a clear error before it is queued and never disturbs the others; no
request-level error can arise inside a step. An exception inside a step (a bug, the GPU failing)
leaves the engine dead: the step's requests and every other one are lost, and every later call
raises `EngineDeadError` saying why, instead of running on from a state nobody can vouch for.
Ctrl-C (KeyboardInterrupt) inside a step aborts every request and keeps the engine usable; with
tensor parallelism it may have cut a message to the workers in half, so it stops them instead.
"""
import atexit
import copy
import dataclasses
import gc
import weakref
from collections import deque
from collections.abc import Iterable
from itertools import count

import torch
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from nanoinfer.config import Config
from nanoinfer.engine.block_manager import BlockManager
from nanoinfer.engine.model_runner import ModelRunner
from nanoinfer.engine.output_processor import OutputProcessor
from nanoinfer.engine.scheduler import Scheduler
from nanoinfer.engine.sequence import Sequence
from nanoinfer.executor.multiproc_executor import MultiprocExecutor
from nanoinfer.outputs import RequestOutput
from nanoinfer.sampling_params import SamplingParams
from nanoinfer.structured_output import Grammar, StructuredOutputManager

PromptType = str | list[int] | dict


class EngineDeadError(RuntimeError):
    pass


# the engine's error while a step runs: still there afterwards if the step (or its Ctrl-C handler)
# was itself cut off, which leaves the engine's state unknown
STEP_CUT_OFF = EngineDeadError("a step was cut off half-way (Ctrl-C twice?): its state is unknown")


atexit.register(gc.unfreeze)   # what LLMEngine froze is freed at exit (extensions check for leaks)


class LLMEngine:

    def __init__(self, config: Config):
        self.config = config
        self.tokenizer = None if config.skip_tokenizer_init else load_tokenizer(config.model)
        # the model runs here (one process, one device) or on tensor-parallel ranks (executor/)
        self.model_executor = ModelRunner(config) if config.tensor_parallel_size == 1 else MultiprocExecutor(config)
        if config.tensor_parallel_size > 1:   # the workers stop with the engine, or at interpreter exit
            weakref.finalize(self, self.model_executor.shutdown)
        block_manager = BlockManager(self.model_executor.num_kvcache_blocks, config.block_size,
                                     config.enable_prefix_caching)
        self.scheduler = Scheduler(config, block_manager)
        self.output_processor = OutputProcessor(self.tokenizer)
        self.structured_output = StructuredOutputManager(self.tokenizer, config.hf_config.vocab_size,
                                                         config.eos_token_ids)
        self.in_flight: deque = deque()   # the outputs of launched steps (`get_output()` waits)
        self.seq_counter = count()
        self.error: BaseException | None = None   # what killed the engine, if anything did
        self.num_prefill_tokens = self.num_decode_tokens = 0   # of the last step, for progress bars
        # The hundreds of thousands of objects start-up made (modules, the tokenizer, parameters) live
        # as long as the engine: take them out of the garbage collector's sight, so that its full
        # collections, which the step loop's allocations trigger now and then, stay short.
        gc.collect()
        gc.freeze()

    def add_request(self, request_id: str, prompt: PromptType, params: SamplingParams | None = None) -> None:
        """Validate and queue a request; raises ValueError saying what is wrong with it."""
        self.check_alive()
        params = SamplingParams() if params is None else params
        if not isinstance(request_id, str) or not request_id:
            raise ValueError(f"request_id must be a non-empty string, got {request_id!r}")
        if request_id in self.output_processor.requests:
            raise ValueError(f"request_id {request_id!r} is already in use by a live request")
        if not isinstance(params, SamplingParams):
            raise ValueError(f"sampling params must be a SamplingParams, got {type(params).__name__}")
        params = copy.deepcopy(params)   # the caller may change or reuse theirs
        text, token_ids = self.tokenize(prompt)
        self.validate(token_ids, params)
        max_tokens = params.max_tokens or self.config.max_model_len - len(token_ids)
        children = [params if params.seed is None else dataclasses.replace(params, seed=wrap64(params.seed + i))
                    for i in range(params.n)]   # the samples of n > 1: seeds seed, seed + 1, ...
        compiled = None if params.guided_decoding is None else self.structured_output.compile(params.guided_decoding)
        seqs = [Sequence(next(self.seq_counter), token_ids, p, max_tokens, self.config.block_size)
                for p in children]
        if compiled is not None:   # each sample its own state in the one compiled grammar
            for seq in seqs:
                seq.grammar = Grammar(compiled)
        self.output_processor.add_request(request_id, text, token_ids, children, [s.seq_id for s in seqs])
        for seq in seqs:
            self.scheduler.add(seq)

    def tokenize(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        if self.tokenizer is None and (isinstance(prompt, str) or (isinstance(prompt, dict)
                                                                   and "prompt_token_ids" not in prompt)):
            raise ValueError("the engine has no tokenizer (skip_tokenizer_init): pass prompt token ids")
        if isinstance(prompt, str):
            return prompt, self.tokenizer.encode(prompt)
        if isinstance(prompt, dict) and "prompt_token_ids" in prompt:
            return prompt.get("prompt"), prompt["prompt_token_ids"]
        if isinstance(prompt, dict) and isinstance(prompt.get("prompt"), str):
            return prompt["prompt"], self.tokenizer.encode(prompt["prompt"])
        if isinstance(prompt, list):
            return None, prompt
        raise ValueError("a prompt must be a str, a list of token ids, or a dict with 'prompt' or "
                         f"'prompt_token_ids', got {type(prompt).__name__}")

    def validate(self, token_ids: list[int], params: SamplingParams) -> None:
        if not isinstance(token_ids, list) or not all(type(t) is int for t in token_ids):
            raise ValueError("prompt token ids must be a list of integers")
        if not token_ids:
            raise ValueError("the prompt is empty: it must have at least one token")
        if len(token_ids) >= self.config.max_model_len:
            raise ValueError(f"the prompt has {len(token_ids)} tokens but max_model_len is "
                             f"{self.config.max_model_len} (prompt and output must fit)")
        vocab_size = self.config.hf_config.vocab_size
        bad = [t for t in token_ids if not 0 <= t < vocab_size]
        if bad:
            raise ValueError(f"prompt token id {bad[0]} is outside the vocabulary [0, {vocab_size})")
        bad = [t for t in params.stop_token_ids if t >= vocab_size]
        if bad:
            raise ValueError(f"stop token id {bad[0]} is outside the vocabulary [0, {vocab_size})")
        if self.tokenizer is None and params.stop:
            raise ValueError("stop strings need a tokenizer; the engine was started with skip_tokenizer_init")
        max_logprobs = min(self.config.max_logprobs, vocab_size)
        if params.logprobs is not None and params.logprobs > max_logprobs:
            raise ValueError(f"SamplingParams.logprobs={params.logprobs} is more than this engine returns "
                             f"(max_logprobs={max_logprobs}, an engine option)")

    def abort_request(self, request_ids: str | Iterable[str]) -> None:
        """Stop requests at once and free their blocks; ids no longer live are ignored."""
        if self.error is not None:
            return   # a dead engine holds no requests
        for request_id in [request_ids] if isinstance(request_ids, str) else request_ids:
            if request_id in self.output_processor.requests:
                for seq_id in self.output_processor.remove_request(request_id):
                    if seq_id in self.scheduler.requests:
                        self.scheduler.finish(self.scheduler.requests[seq_id], "abort")

    def has_unfinished_requests(self) -> bool:
        self.check_alive()
        return self.scheduler.has_unfinished() or bool(self.in_flight)

    def check_alive(self) -> None:
        if isinstance(self.error, EngineDeadError):
            raise EngineDeadError(str(self.error))
        if self.error is not None:
            raise EngineDeadError(f"the engine stopped after an error in a step ({type(self.error).__name__}: "
                                  f"{self.error}); its requests are lost: create a new engine") from self.error

    def step(self) -> list[RequestOutput]:
        self.check_alive()
        self.error = STEP_CUT_OFF   # until the step, or its handler below, is through
        try:
            outputs = self._step()
        except KeyboardInterrupt as e:   # the user stopped it: drop every request, keep the engine
            if self.config.tensor_parallel_size == 1:
                self.error = None
                self.abort_all()
                raise
            self.die(e)   # a message to the workers may be cut in half: stop them
            raise
        except BaseException as e:
            self.die(e)
            raise
        self.error = None
        return outputs

    def die(self, error: BaseException) -> None:
        self.error = error
        self.in_flight.clear()
        self.shutdown(graceful=False)

    def shutdown(self, graceful: bool = True) -> None:
        """Stop the tensor-parallel workers and free the model and its KV cache; the engine cannot
        be used afterwards. Idempotent."""
        if self.model_executor is None:
            return
        if isinstance(self.model_executor, MultiprocExecutor):
            self.model_executor.shutdown(graceful)
        self.model_executor = None
        self.structured_output.shutdown()
        self.error = self.error or EngineDeadError("the engine was shut down")
        gc.unfreeze()   # let the collector free the model's reference cycles
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()

    def abort_all(self) -> None:
        """Abort every request. A step cut off half-way may have entered blocks in the prefix
        cache whose keys and values were never computed, so the prefix cache is emptied too."""
        self.structured_output.rows.clear()   # the runner may have missed a step's masks ...
        self.in_flight.clear()
        self.abort_request(list(self.output_processor.requests))
        self.scheduler.block_manager.reset_prefix_cache()
        self.model_executor.reset()   # ... or its message

    def _step(self) -> list[RequestOutput]:
        sched = self.scheduler.schedule()
        self.model_executor.execute_model(sched)
        core_outputs, self.scheduler.unstepped_outputs = self.scheduler.unstepped_outputs, []
        grammar = None
        if self.scheduler.has_guided(sched):   # their states must have seen the step in flight's tokens
            while self.in_flight:
                core_outputs += self.scheduler.update_from_output(self.in_flight.popleft().get_output())
            grammar = self.structured_output.grammar_bitmask(self.scheduler.requests, sched)
        elif not sched.num_scheduled_tokens and self.scheduler.waiting and not self.in_flight:
            self.structured_output.wait_for_compilation(self.scheduler.waiting)
        self.in_flight.append(self.model_executor.sample_tokens(grammar))
        self.num_prefill_tokens = sum(n for n in sched.num_scheduled_tokens.values() if n > 1)
        self.num_decode_tokens = sum(1 for n in sched.num_scheduled_tokens.values() if n == 1)
        # async scheduling leaves the step just launched in flight and finishes the one before
        keep = 1 if self.config.async_scheduling and sched.num_scheduled_tokens else 0
        while len(self.in_flight) > keep:
            core_outputs += self.scheduler.update_from_output(self.in_flight.popleft().get_output())
        outputs, stopped = self.output_processor.process_outputs(core_outputs)
        for seq_id, stop_string in stopped:
            self.scheduler.finish(self.scheduler.requests[seq_id], "stop", stop_string)
        return outputs


def wrap64(x: int) -> int:
    """x as a signed 64-bit integer (wrapping around)."""
    return (x + 2**63) % 2**64 - 2**63


def load_tokenizer(model: str) -> PreTrainedTokenizerBase:
    try:
        return AutoTokenizer.from_pretrained(model)
    except (OSError, ValueError) as e:
        raise ValueError(f"cannot load a tokenizer from {model!r}: {e}") from e
