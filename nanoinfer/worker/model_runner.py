"""Runs the model for one scheduled step, in two phases.

`execute_model(scheduler_output)` applies the step message to the runner's persistent batch
(`input_batch.py`), flattens the step into one unpadded batch (the new tokens of every scheduled
request back to back: `input_ids`, `positions`, where each one's K/V goes, per request its query
range, key count and block table), runs the forward and computes the logits of the requests that
sample: their last hidden state goes through the LM head; the others' prompt chunks only fill the
cache. It returns the step as an `ExecutedStep`, which the engine hands back to
`sample_tokens(executed, grammar)`: that processes the logits on the device (a guided request's
bitmask, min_tokens, penalties) and samples. The runner never sees a `Sequence`: the message is
all it is told, so a worker in another process can run the same step from the same message.

The KV cache is one tensor [2 (K, V), layers, blocks, block_size, kv_heads, head_dim]; each
attention layer gets a view of its own slice. On a GPU its size is what is left of
`gpu_memory_utilization` after the weights and the activation peak of a profiling forward at
the largest step (`max_num_batched_tokens` tokens) and the CUDA graphs' memory; decode steps and
small prefill steps then replay CUDA graphs.
Nothing here waits for the GPU: the sampled tokens come back through an
`AsyncModelRunnerOutput`, and the next step's decodes take theirs on the device.

The optional mechanisms, each behind one call: `load_kv` and `save_kv` (a KV connector,
kv_transfer/), `score_prompts` (prompt logprobs), `self.drafter` (EAGLE or Medusa drafts,
spec_decode/) and pipeline parallelism in `run_model`: a stage runs only its layers, every stage
but the first receives the previous stage's hidden states and residual before its forward, every
stage but the last sends its own after it, and only the last computes logits and samples (its
first tensor-parallel rank is the driver, which returns the tokens).
"""
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from nanoinfer.attention import get_attn_backend, set_forward_context
from nanoinfer.config import Config
from nanoinfer.core.messages import GrammarOutput, SchedulerOutput
from nanoinfer.distributed import get_pp_group, get_tp_group
from nanoinfer.kv_transfer import make_kv_connector
from nanoinfer.layers.attention import Attention
from nanoinfer.layers.sampler import Sampler, SamplerOutput, score_prompt_tokens
from nanoinfer.models import MODEL_REGISTRY
from nanoinfer.models.loader import init_dummy_weights, load_model
from nanoinfer.spec_decode import make_drafter
from nanoinfer.spec_decode.rejection_sampler import accept_drafts
from nanoinfer.worker.async_output import AsyncModelRunnerOutput, to_host
from nanoinfer.worker.cuda_graph import CUDAGraphRunner
from nanoinfer.worker.input_batch import InputBatch, StepInputs
from nanoinfer.worker.kv_cache import (allocate_kv_cache, check_kv_cache_holds_max_model_len,
                                       profile_free_memory)


@dataclass
class ExecutedStep:
    """A step whose forward is launched, on its way to `sample_tokens`: its inputs (None when it
    computed nothing, only loaded KV blocks), the last stage's hidden states at every position
    (None on an earlier stage), the logits of the rows that sample (on the rank that samples);
    and the optional mechanisms': seq_id -> its KV blocks loaded, the blocks to save after it
    (kv_transfer/), and the (layout, rows) of its prompt tokens' logprobs."""
    step: StepInputs | None = None
    hidden_states: torch.Tensor | None = None
    logits: torch.Tensor | None = None
    kv_loaded: dict[int, int] | None = None
    kv_saves: list[tuple[int, int]] = field(default_factory=list)
    prompt_logprobs: tuple | None = None


class ModelRunner:

    def __init__(self, config: Config, kv_connector=None):
        self.config = config
        self.dtype = config.torch_dtype
        self.device = torch.device(config.device)
        if self.device.type == "cuda":   # (under tensor parallelism: this rank's GPU)
            self.device = torch.device("cuda", torch.cuda.current_device())
        # this process's groups (a worker's: set up by the executor; else of one rank)
        self.tp_group, self.pp_group = get_tp_group(), get_pp_group()
        # Before the weights load: could the KV cache hold max_model_len at all?
        gpu_bytes = None
        if self.device.type == "cuda":
            gpu_bytes = torch.cuda.mem_get_info(self.device)[1] * config.gpu_memory_utilization
        # (the block count comes later: after the weights, from what a profiling step leaves)
        check_kv_cache_holds_max_model_len(config, gpu_bytes, config.kv_cache_bytes_per_token())
        self.model, self.drafter = self.load_model()
        self.sampler = Sampler()
        self.input_batch = InputBatch(config, self.device)
        self.attn_layers = self.attention_layers()
        rank = dist.get_rank() if dist.is_initialized() else 0
        self.kv_connector = kv_connector or make_kv_connector(config, rank)
        self.kv_cache = self.init_kv_cache()
        self.num_kvcache_blocks = self.kv_cache.shape[2]
        self.graph_runner = None
        if self.device.type == "cuda" and not config.enforce_eager:
            self.graph_runner = CUDAGraphRunner(self.model, config, self.device,
                                                self.pp_group.is_first, self.pp_group.is_last)
            self.input_batch.max_flat_rows = self.graph_runner.batch_sizes[-1]

    def load_model(self) -> tuple[torch.nn.Module, object]:
        """The model, built on the device in its dtype, with its weights; and the drafter."""
        config = self.config
        default_dtype = torch.get_default_dtype()
        torch.manual_seed(config.seed)
        torch.set_default_dtype(self.dtype)
        try:
            with torch.device(self.device):
                arch = next(a for a in config.hf_config.architectures if a in MODEL_REGISTRY)
                model = MODEL_REGISTRY[arch](config.hf_config, config.max_model_len)
                drafter = make_drafter(config, model, self.tp_group)
        finally:
            torch.set_default_dtype(default_dtype)
        if config.load_format == "dummy":
            init_dummy_weights(model)
        else:
            load_model(model, config.model)
        return model, drafter

    def attention_layers(self) -> list[Attention]:
        """Every attention layer (EAGLE's too), each given the configured backend."""
        modules = [*self.model.modules(), *(self.drafter.modules() if self.drafter else ())]
        layers = [m for m in modules if isinstance(m, Attention)]
        backend = get_attn_backend(self.config.attention_backend)
        for layer in layers:
            layer.backend = backend
        return layers

    def init_kv_cache(self) -> torch.Tensor:
        """The KV cache (kv_cache.py): as many blocks as `num_kvcache_blocks`, the CPU's cache
        space, or the GPU memory a profiling step leaves; every rank takes the smallest count."""
        config = self.config
        free_bytes = None
        if self.device.type == "cuda" and config.num_kvcache_blocks is None:
            # (less what a KV connector keeps on the device)
            free_bytes = profile_free_memory(self) - getattr(self.kv_connector, "device_bytes", 0)
        bytes_per_token = config.kv_cache_bytes_per_token(self.pp_group.rank_in_group)
        num_blocks = check_kv_cache_holds_max_model_len(config, free_bytes, bytes_per_token)
        num_blocks = self.min_over_ranks(torch.tensor([num_blocks], device=self.device))
        return allocate_kv_cache(self.attn_layers, int(num_blocks.item()), config.block_size,
                                 self.dtype, self.device)

    def min_over_ranks(self, counts: torch.Tensor) -> torch.Tensor:
        """The smallest of every tensor- and pipeline-parallel rank's `counts`, in place."""
        for group in (self.tp_group, self.pp_group):
            group.all_reduce(counts, op=dist.ReduceOp.MIN)
        return counts

    def reset(self) -> None:
        """Forget every request (the engine aborted them all)."""
        self.input_batch.clear()

    @torch.inference_mode()
    def execute_model(self, sched: SchedulerOutput) -> ExecutedStep:
        """Apply the step message, launch the forward and the logits of the requests that
        sample, and return without waiting: on a GPU the host can go on while the step runs."""
        self.input_batch.update(sched)
        executed = ExecutedStep(kv_loaded=self.load_kv(sched), kv_saves=sched.kv_saves)
        if not sched.num_scheduled_tokens:
            return executed
        executed.step = step = self.input_batch.prepare_inputs(sched)
        executed.hidden_states = hidden_states = self.run_model(step)
        if hidden_states is None:   # (a pipeline stage before the last: sent on)
            return executed
        if step.prompt_logprobs is not None:
            executed.prompt_logprobs = self.score_prompts(step, hidden_states)
        if step.sample_seq_ids:
            executed.logits = self.model.compute_logits(hidden_states[step.logits_indices])
        return executed

    def run_model(self, step: StepInputs) -> torch.Tensor | None:
        """The forward: a CUDA graph's replay where one holds the step, else eager. A pipeline
        stage after the first receives its input first; one before the last sends its output
        on (and returns None)."""
        intermediate = self.intermediate(len(step.input_ids))
        for t in intermediate or ():   # (the previous stage's output)
            self.pp_group.recv_prev(t)
        meta = step.attn_metadata
        graph = self.graph_runner and self.graph_runner.graph_size(meta, len(step.input_ids))
        if graph:
            hidden_states = self.graph_runner.run(graph, step.input_ids, step.positions, meta,
                                                  intermediate)
        else:
            with set_forward_context(meta):
                hidden_states = self.model(step.input_ids, step.positions, intermediate)
        if self.pp_group.is_last:
            return hidden_states
        for t in hidden_states:   # (to the next stage)
            self.pp_group.send_next(t)
        return None

    def intermediate(self, num_tokens: int, make=torch.empty) -> tuple | None:
        """Buffers for the previous stage's hidden states and residual (None on the first)."""
        if self.pp_group.is_first:
            return None
        shape = (num_tokens, self.config.hf_config.hidden_size)
        return tuple(make(shape, dtype=self.dtype, device=self.device) for _ in range(2))

    @torch.inference_mode()
    def sample_tokens(self, executed: ExecutedStep, grammar: GrammarOutput | None = None
                      ) -> AsyncModelRunnerOutput:
        """Process the executed step's logits and sample (still without waiting for the GPU);
        `grammar`: the bitmask of the constrained requests' rows (structured output)."""
        step = executed.step
        hidden_states = executed.hidden_states
        sampled = drafts = None
        if executed.logits is not None:
            # This rank samples: the base path.
            sampled, drafts = self.sample(step, executed.logits, hidden_states, grammar)
        elif hidden_states is not None and step.sample_seq_ids:
            # A tensor-parallel rank that does not sample: rank 0 sends it the tokens.
            self.receive_tokens(step, hidden_states)
        elif hidden_states is not None and self.config.num_lookahead_tokens:
            # Prompt chunks only: EAGLE's layer writes their keys and values too.
            self.propose_drafts(step, hidden_states, None)
        # (No forward here at all: KV blocks loaded only, or a pipeline stage before the last.)
        # The step's blocks are saved after EAGLE's layer too, and its output waits for them.
        kv_saved = self.save_kv(executed.kv_saves) if executed.kv_saves else None
        return AsyncModelRunnerOutput(
            seq_ids=step.sample_seq_ids if sampled else [], sampled=sampled, drafts=drafts,
            rows_per_request=step.rows_per_request if step else None, kv_loaded=executed.kv_loaded,
            prompt_logprobs=executed.prompt_logprobs, kv_saved=kv_saved)

    def sample(self, step: StepInputs, logits: torch.Tensor, hidden_states: torch.Tensor,
               grammar: GrammarOutput | None) -> tuple[SamplerOutput, torch.Tensor | None]:
        """The step's sampled tokens (with drafts: the accepted ones and the target's next), and
        the next step's drafts."""
        sampled = self.sampler(logits, self.input_batch.sampling_metadata(step, grammar))
        # With drafts, every sample row drew one token: keep the accepted drafts and the next.
        if step.num_drafts is not None:
            sampled.sampled_token_ids = accept_drafts(
                sampled.sampled_token_ids[:, 0], step.draft_token_ids, step.num_drafts)
        # Every rank keeps them: the next step's decodes take their inputs from them.
        self.tp_group.broadcast(sampled.sampled_token_ids)
        self.input_batch.record_sampled(step.sample_seq_ids, sampled.sampled_token_ids)
        return sampled, self.propose_drafts(step, hidden_states, sampled.sampled_token_ids)

    def receive_tokens(self, step: StepInputs, hidden_states: torch.Tensor) -> None:
        """A rank that does not sample takes the tokens rank 0 sampled (the next step's inputs),
        and drafts with them (EAGLE's layers are split over the ranks)."""
        width = 1 + (0 if step.draft_token_ids is None else step.draft_token_ids.shape[1])
        token_ids = torch.empty(len(step.sample_seq_ids), width, dtype=torch.int64,
                                device=self.device)
        self.input_batch.record_sampled(step.sample_seq_ids, self.tp_group.broadcast(token_ids))
        self.propose_drafts(step, hidden_states, token_ids)

    def propose_drafts(self, step: StepInputs, hidden_states: torch.Tensor,
                       token_ids: torch.Tensor | None) -> torch.Tensor | None:
        """The next step's drafts (EAGLE, Medusa), from the position of each request's last
        emitted token. token_ids: the step's emitted tokens, [requests, k + 1], padded with -1
        (None: nobody samples; EAGLE still writes the step's keys and values)."""
        if self.drafter is None:
            return None
        if token_ids is None:
            empty = torch.empty(0, dtype=torch.int64, device=self.device)
            return self.drafter.propose(step, hidden_states, empty, empty)
        num_emitted = (token_ids >= 0).sum(1)
        first_row = torch.arange(len(token_ids), device=self.device) if step.num_drafts is None \
            else torch.cumsum(step.num_drafts + 1, 0) - step.num_drafts - 1
        last_rows = step.logits_indices[first_row + num_emitted - 1]
        emitted = token_ids.gather(1, (num_emitted - 1).unsqueeze(1)).squeeze(1)
        return self.drafter.propose(step, hidden_states, last_rows, emitted)

    def score_prompts(self, step: StepInputs, hidden_states: torch.Tensor) -> tuple:
        """The logprobs of the step's prompt tokens that want them, on their way to the host."""
        layout, index, targets, num_top = step.prompt_logprobs
        rows = score_prompt_tokens(self.model.compute_logits, hidden_states, index, targets,
                                   num_top)
        return layout, None if rows is None else to_host(rows)

    def load_kv(self, sched: SchedulerOutput) -> dict[int, int] | None:
        """Fill the step's blocks from the KV connector, every rank its own; the ranks agree on
        how many of each request's are good (the smallest count)."""
        if not sched.kv_loads:
            return None
        counts = torch.tensor([self.kv_connector.load_kv(blocks, self.kv_cache)
                               for blocks in sched.kv_loads.values()], device=self.device)
        return dict(zip(sched.kv_loads, self.min_over_ranks(counts).tolist()))

    def save_kv(self, blocks: list[tuple[int, int]]) -> tuple:
        """Queue the step's computed blocks for the KV connector; (its saver, the ticket)."""
        return self.kv_connector.saver, self.kv_connector.save_kv(blocks, self.kv_cache)
