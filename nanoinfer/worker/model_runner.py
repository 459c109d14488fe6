"""Runs the model for one scheduled step, in two phases.

`execute_model(scheduler_output)` applies the step message to the runner's persistent batch
(`input_batch.py`), flattens the step into one unpadded batch (the new tokens of every scheduled
request back to back: `input_ids`, `positions`, where each one's K/V goes, per request its query
range, key count and block table), runs the forward and computes the logits of the requests that
sample: their last hidden state goes through the LM head; the others' prompt chunks only fill the
cache. `sample_tokens(grammar)` then processes those logits on the device (a guided request's
bitmask, min_tokens, penalties) and samples. The runner never sees a `Sequence`: the message
is all it is told, so a worker in another process can run the same step from the same message.

The KV cache is one tensor [2 (K, V), layers, blocks, block_size, kv_heads, head_dim]; each
attention layer gets a view of its own slice. On a GPU its size is what is left of
`gpu_memory_utilization` after the weights and the activation peak of a profiling forward at
the largest step (`max_num_batched_tokens` tokens); pure-decode steps then replay CUDA graphs.
Nothing here waits for the GPU: the sampled tokens come back through an
`AsyncModelRunnerOutput`, and the next step's decodes take theirs on the device.

A pipeline stage runs only its layers: every stage but the first receives the previous stage's
hidden states and residual before its forward, every stage but the last sends its own after it,
and only the last computes logits and samples (its first tensor-parallel rank is the driver, which
returns the tokens).
"""

import torch
import torch.distributed as dist

from nanoinfer.attention import AttentionMetadata, get_attn_backend, set_forward_context
from nanoinfer.config import Config
from nanoinfer.distributed import get_pp_group, get_tp_group
from nanoinfer.worker.async_output import AsyncModelRunnerOutput, to_host
from nanoinfer.worker.cuda_graph import CUDAGraphRunner
from nanoinfer.worker.input_batch import InputBatch, StepInputs
from nanoinfer.core.messages import GrammarOutput, SchedulerOutput
from nanoinfer.kv_transfer import make_kv_connector
from nanoinfer.layers.attention import Attention
from nanoinfer.layers.sampler import Sampler, SamplingMetadata, score_prompt_tokens
from nanoinfer.models import MODEL_REGISTRY
from nanoinfer.models.loader import init_dummy_weights, load_model
from nanoinfer.spec_decode.eagle import EagleProposer
from nanoinfer.spec_decode.medusa import Medusa
from nanoinfer.spec_decode.rejection_sampler import accept_drafts


class ModelRunner:

    def __init__(self, config: Config, kv_connector=None):
        self.config = config
        self.device = torch.device(config.device)
        if self.device.type == "cuda":   # under tensor parallelism, this rank's GPU
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.tp_group = get_tp_group()   # this process's (a worker's: set up by the executor; else one rank)
        self.pp_group = get_pp_group()
        self.dtype = config.torch_dtype
        self.block_size = config.block_size
        hf_config = config.hf_config
        arch = next(a for a in hf_config.architectures if a in MODEL_REGISTRY)
        gpu_bytes = None   # at most this much of the GPU can go to the KV cache: check before loading weights
        if self.device.type == "cuda":
            gpu_bytes = torch.cuda.mem_get_info(self.device)[1] * config.gpu_memory_utilization
        self.check_kv_cache_holds_max_model_len(gpu_bytes, config.kv_cache_bytes_per_token)
        torch.manual_seed(config.seed)
        default_dtype = torch.get_default_dtype()
        torch.set_default_dtype(self.dtype)
        spec = config.speculative
        self.drafter = None   # EAGLE (every rank), or Medusa heads (on the rank that samples)
        try:
            with torch.device(self.device):
                self.model = MODEL_REGISTRY[arch](hf_config, config.max_model_len)
                if spec is not None and spec.method == "eagle":
                    self.drafter = EagleProposer(spec.model, spec.num_speculative_tokens, self.model, hf_config,
                                                 config.max_model_len, self.block_size)
        finally:
            torch.set_default_dtype(default_dtype)
        if config.load_format == "dummy":
            init_dummy_weights(self.model)
        else:
            load_model(self.model, config.model)
        self.sampler = Sampler()
        if spec is not None and spec.method == "medusa" and self.tp_group.rank_in_group == 0:
            self.drafter = Medusa(spec.model, spec.num_speculative_tokens, hf_config.hidden_size,
                                  hf_config.vocab_size).to(self.device, self.dtype)
        self.input_batch = InputBatch(config.max_num_seqs, config.max_model_len, self.block_size,
                                      hf_config.vocab_size, config.eos_token_ids, self.device, config.seed,
                                      spec.num_speculative_tokens if isinstance(self.drafter, EagleProposer) else 0)
        drafter_modules = self.drafter.model.modules() if isinstance(self.drafter, EagleProposer) else ()
        self.attn_layers = [m for m in (*self.model.modules(), *drafter_modules) if isinstance(m, Attention)]
        backend = get_attn_backend(config.attention_backend)
        for layer in self.attn_layers:
            layer.backend = backend
        self.kv_connector = kv_connector or make_kv_connector(config, dist.get_rank() if dist.is_initialized() else 0)
        self.allocate_kv_cache()
        self.kv_loaded: dict[int, int] | None = None   # the step's loaded KV blocks, for its output
        self.kv_saves: list[tuple[int, int]] = []   # the step's blocks to save, once sampled
        self.prompt_logprobs = None   # (layout, rows) of the step's prompt tokens, for its output
        self.pending: tuple[StepInputs, torch.Tensor, torch.Tensor] | None = None   # executed, not sampled
        self.graph_runner = None
        if self.device.type == "cuda" and not config.enforce_eager:
            self.graph_runner = CUDAGraphRunner(
                self.model, min(config.max_num_seqs, 512), -(-config.max_model_len // self.block_size),
                hf_config.hidden_size, self.dtype, self.device, self.pp_group.is_first, self.pp_group.is_last)
            self.input_batch.max_flat_rows = self.graph_runner.batch_sizes[-1]
        if self.kv_connector is not None:   # (a consumer receives from now: not while capturing)
            self.kv_connector.register_kv_caches(self.kv_cache)

    def check_kv_cache_holds_max_model_len(self, kv_cache_bytes: float | None, bytes_per_token: int) -> int:
        """The number of KV cache blocks (from `num_kvcache_blocks`, the CPU's cache space, or
        `kv_cache_bytes`); a ValueError if they cannot hold one sequence of max_model_len tokens."""
        num_blocks = self.config.num_kvcache_blocks
        if num_blocks is None:
            if kv_cache_bytes is None:
                kv_cache_bytes = self.config.cpu_kvcache_space_gb * 2**30
            num_blocks = int(kv_cache_bytes) // (self.block_size * bytes_per_token)
        if num_blocks * self.block_size < self.config.max_model_len:
            raise ValueError(
                f"the KV cache holds {max(num_blocks, 0) * self.block_size} tokens, fewer than max_model_len="
                f"{self.config.max_model_len}: lower max_model_len or give the cache more memory")
        return num_blocks

    def allocate_kv_cache(self) -> None:
        free_bytes = None
        if self.device.type == "cuda" and self.config.num_kvcache_blocks is None:
            free_bytes = self.profile_free_memory() - getattr(self.kv_connector, "device_bytes", 0)
        num_kv_heads, head_dim = self.attn_layers[0].num_kv_heads, self.attn_layers[0].head_dim
        shape = (len(self.attn_layers), self.block_size, num_kv_heads, head_dim)
        bytes_per_token = 2 * shape[0] * num_kv_heads * head_dim * self.dtype.itemsize   # this rank's heads
        num_blocks = self.check_kv_cache_holds_max_model_len(free_bytes, bytes_per_token)
        # every rank's cache must hold the blocks the scheduler hands out: take the smallest
        num_blocks = torch.tensor([num_blocks], device=self.device)
        for group in (self.tp_group, self.pp_group):
            group.all_reduce(num_blocks, op=dist.ReduceOp.MIN)
        num_blocks = int(num_blocks.item())
        self.num_kvcache_blocks = num_blocks
        self.kv_cache = torch.empty(2, shape[0], num_blocks, *shape[1:], dtype=self.dtype, device=self.device)
        for i, layer in enumerate(self.attn_layers):
            layer.k_cache, layer.v_cache = self.kv_cache[0, i], self.kv_cache[1, i]

    @torch.inference_mode()
    def profile_free_memory(self) -> float:
        """Bytes for the KV cache: run the largest step (without a real cache) and see what is left."""
        num_tokens, max_len = self.config.max_num_batched_tokens, self.config.max_model_len - 1
        lens = [max_len] * (num_tokens // max_len) + ([num_tokens % max_len] if num_tokens % max_len else [])
        cu_seqlens_q = torch.tensor([0] + lens, device=self.device).cumsum(0).to(torch.int32)
        meta = AttentionMetadata(   # every key read from one dummy block, nothing written
            cu_seqlens_q=cu_seqlens_q, context_lens=torch.tensor(lens, dtype=torch.int32, device=self.device),
            slot_mapping=torch.full((num_tokens,), -1, dtype=torch.int64, device=self.device),
            block_tables=torch.zeros(len(lens), -(-max(lens) // self.block_size), dtype=torch.int32,
                                     device=self.device),
            max_seqlen_q=max(lens))
        dummy = torch.zeros(1, self.block_size, self.attn_layers[0].num_kv_heads, self.attn_layers[0].head_dim,
                            dtype=self.dtype, device=self.device)
        for layer in self.attn_layers:
            layer.k_cache = layer.v_cache = dummy
        torch.cuda.reset_peak_memory_stats(self.device)
        before = torch.cuda.memory_allocated(self.device)
        positions = torch.cat([torch.arange(n, device=self.device) for n in lens])
        with set_forward_context(meta):
            hidden_states = self.model(torch.zeros(num_tokens, dtype=torch.int64, device=self.device), positions,
                                       self.intermediate(num_tokens, torch.zeros))
        spec = self.config.speculative   # (k + 1 sample rows a sequence when speculating)
        rows = min(self.config.max_num_seqs * (1 + (spec.num_speculative_tokens if spec else 0)), num_tokens)
        logits = None   # (ranks other than the last stage's first have none)
        if self.pp_group.is_last:
            logits = self.model.compute_logits(hidden_states[:rows])
        if logits is not None:
            self.sampler(logits.float(), SamplingMetadata(
                temperatures=torch.ones(rows, device=self.device), top_ks=None,
                top_ps=torch.full((rows,), 0.9, device=self.device), min_ps=None,
                seeds=torch.zeros(rows, dtype=torch.int64, device=self.device), all_greedy=False,
                max_num_logprobs=None))
        torch.cuda.synchronize(self.device)
        peak = torch.cuda.max_memory_allocated(self.device) - before
        del hidden_states, logits
        torch.cuda.empty_cache()
        free, total = torch.cuda.mem_get_info(self.device)
        return total * self.config.gpu_memory_utilization - (total - free) - peak

    def intermediate(self, num_tokens: int, make=torch.empty) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Buffers for the previous stage's hidden states and residual (None on the first stage)."""
        if self.pp_group.is_first:
            return None
        shape = (num_tokens, self.config.hf_config.hidden_size)
        return make(shape, dtype=self.dtype, device=self.device), make(shape, dtype=self.dtype, device=self.device)

    def reset(self) -> None:
        """Forget every request (the engine aborted them all)."""
        self.input_batch.clear()
        self.pending, self.kv_loaded, self.kv_saves, self.prompt_logprobs = None, None, [], None

    @torch.inference_mode()
    def execute_model(self, sched: SchedulerOutput) -> None:
        """Apply the step message, launch the forward and the logits of the requests that sample,
        and return without waiting: on a GPU the host can go on while the step runs."""
        self.input_batch.update(sched)
        self.pending, self.kv_saves = None, sched.kv_saves
        if sched.kv_loads:   # a KV connector's blocks, every rank its own; the ranks agree on how many
            counts = torch.tensor([self.kv_connector.load_kv(blocks, self.kv_cache) for blocks in sched.kv_loads.values()],
                                  device=self.device)
            for group in (self.tp_group, self.pp_group):
                group.all_reduce(counts, op=dist.ReduceOp.MIN)
            self.kv_loaded = dict(zip(sched.kv_loads, counts.tolist()))
        if not sched.num_scheduled_tokens:
            return
        step = self.input_batch.prepare_inputs(sched)
        meta = step.attn_metadata
        intermediate = self.intermediate(len(step.input_ids))
        for t in intermediate or ():   # the previous stage's output
            self.pp_group.recv_prev(t)
        if self.graph_runner is not None and self.graph_runner.can_run(meta, len(step.input_ids)):
            hidden_states = self.graph_runner.run(step.input_ids, step.positions, meta, intermediate)
        else:
            with set_forward_context(meta):
                hidden_states = self.model(step.input_ids, step.positions, intermediate)
        if not self.pp_group.is_last:   # to the next stage; the last samples
            for t in hidden_states:
                self.pp_group.send_next(t)
            return
        if step.prompt_logprobs is not None:
            layout, index, targets, num_top = step.prompt_logprobs
            rows = score_prompt_tokens(self.model.compute_logits, hidden_states, index, targets,
                                       num_top)
            self.prompt_logprobs = layout, None if rows is None else to_host(rows)
        if step.sample_seq_ids:
            self.pending = step, self.model.compute_logits(hidden_states[step.logits_indices]), hidden_states
        elif isinstance(self.drafter, EagleProposer):   # a prompt chunk: its keys and values for EAGLE too
            empty = torch.empty(0, dtype=torch.int64, device=self.device)
            self.drafter.propose(step, hidden_states, empty, empty, self.tp_group)

    def sample_tokens(self, grammar: GrammarOutput | None = None) -> AsyncModelRunnerOutput:
        """Process the executed step's logits and sample (still without waiting for the GPU);
        `grammar`: the bitmask of the constrained requests' rows (structured output)."""
        output = self.sample(grammar)
        output.kv_loaded, output.prompt_logprobs, self.kv_loaded, self.prompt_logprobs = \
            self.kv_loaded, self.prompt_logprobs, None, None
        if self.kv_saves:   # (after EAGLE's layer too; the step's output waits for them)
            output.kv_saved = self.kv_connector.saver, self.kv_connector.save_kv(self.kv_saves,
                                                                                 self.kv_cache)
            self.kv_saves = []
        return output

    @torch.inference_mode()
    def sample(self, grammar: GrammarOutput | None) -> AsyncModelRunnerOutput:
        if self.pending is None:
            return AsyncModelRunnerOutput([])
        step, logits, hidden_states = self.pending
        self.pending = None
        if logits is None:   # a tensor-parallel worker: the first rank samples and sends the tokens
            width = 1 + (0 if step.draft_token_ids is None else step.draft_token_ids.shape[1])
            token_ids = torch.empty(len(step.sample_seq_ids), width, dtype=torch.int64, device=self.device)
            self.input_batch.record_sampled(step.sample_seq_ids, self.tp_group.broadcast(token_ids))
            self.propose_drafts(step, hidden_states, token_ids)   # (EAGLE's layers are split over the ranks)
            return AsyncModelRunnerOutput([])
        sampled = self.sampler(logits, self.input_batch.sampling_metadata(step, grammar))
        rows_per_request = None
        if step.num_drafts is not None:   # keep the accepted drafts and the target's next token
            sampled.sampled_token_ids = accept_drafts(sampled.sampled_token_ids[:, 0], step.draft_token_ids,
                                                      step.num_drafts)
            rows_per_request = step.rows_per_request
        self.tp_group.broadcast(sampled.sampled_token_ids)   # the next step's decode inputs, on every rank
        self.input_batch.record_sampled(step.sample_seq_ids, sampled.sampled_token_ids)
        drafts = self.propose_drafts(step, hidden_states, sampled.sampled_token_ids)
        return AsyncModelRunnerOutput(step.sample_seq_ids, sampled, rows_per_request, drafts)

    def propose_drafts(self, step: StepInputs, hidden_states: torch.Tensor, token_ids: torch.Tensor
                       ) -> torch.Tensor | None:
        """The next step's drafts (EAGLE, Medusa), from the position of each request's last
        emitted token. token_ids: the step's emitted tokens, [requests, k + 1], padded with -1."""
        if self.drafter is None:
            return None
        num_emitted = (token_ids >= 0).sum(1)
        first_row = torch.arange(len(token_ids), device=self.device) if step.num_drafts is None else \
            torch.cumsum(step.num_drafts + 1, 0) - step.num_drafts - 1
        last_rows = step.logits_indices[first_row + num_emitted - 1]
        if isinstance(self.drafter, Medusa):
            return self.drafter.propose(hidden_states[last_rows])
        emitted = token_ids.gather(1, (num_emitted - 1).unsqueeze(1)).squeeze(1)
        return self.drafter.propose(step, hidden_states, last_rows, emitted, self.tp_group)
