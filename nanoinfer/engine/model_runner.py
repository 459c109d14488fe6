"""Runs the model for one scheduled step.

`prepare_inputs` flattens the step into one unpadded batch: the new tokens of every scheduled
sequence back to back (`input_ids`, `positions`), where each one's K/V goes (`slot_mapping`),
and per sequence its query range (`cu_seqlens_q`), key count (`context_lens`) and block table.
Only sequences whose step reaches their last token are sampled: their last hidden state goes
through the LM head, the others' prompt chunks just fill the cache.

The KV cache is one tensor [2 (K, V), layers, blocks, block_size, kv_heads, head_dim]; each
attention layer gets a view of its own slice. On a GPU its size is what is left of
`gpu_memory_utilization` after the weights and the activation peak of a profiling forward at
the largest step (`max_num_batched_tokens` tokens); pure-decode steps then replay CUDA graphs.
Step inputs are built as Python lists, put in pinned host memory and copied without blocking.
Nothing in `execute_model` waits for the GPU: the sampled tokens come back through an
`AsyncModelRunnerOutput`, and a decode whose input token is still being sampled by the previous
step (async scheduling) gathers it from that step's output on the device.
"""
from dataclasses import dataclass, field

import numpy as np
import torch

from nanoinfer.attention import AttentionMetadata, get_attn_backend, set_forward_context
from nanoinfer.config import Config
from nanoinfer.engine.cuda_graph import CUDAGraphRunner
from nanoinfer.engine.scheduler import SchedulerOutput
from nanoinfer.engine.sequence import Sequence
from nanoinfer.layers.attention import Attention
from nanoinfer.layers.sampler import Sampler, SamplerOutput, SamplingMetadata
from nanoinfer.models import MODEL_REGISTRY
from nanoinfer.models.loader import init_dummy_weights, load_model


@dataclass
class ModelRunnerOutput:
    sampled_token_ids: dict[int, int] = field(default_factory=dict)       # seq_id -> token
    logprobs: dict[int, dict[int, float]] = field(default_factory=dict)   # seq_id -> {token: logprob}


class AsyncModelRunnerOutput:
    """A launched step's sampled tokens on their way to the host: `get_output` waits for them."""

    def __init__(self, seqs: list[Sequence], sampled: SamplerOutput | None = None):
        self.seqs, self.sampled, self.copied = seqs, None, None
        if sampled is not None:   # copies queued behind the step's kernels; the host goes on
            self.sampled = SamplerOutput(*(t if t is None else t.to("cpu", non_blocking=True)
                                           for t in (sampled.token_ids, sampled.logprobs, sampled.logprob_token_ids)))
            if sampled.token_ids.is_cuda:
                self.copied = torch.cuda.Event()
                self.copied.record()

    def get_output(self) -> ModelRunnerOutput:
        out = ModelRunnerOutput()
        if self.sampled is None:
            return out
        if self.copied is not None:
            self.copied.synchronize()
        token_ids = self.sampled.token_ids.tolist()
        out.sampled_token_ids = {seq.seq_id: t for seq, t in zip(self.seqs, token_ids)}
        if self.sampled.logprobs is not None:
            ids, lps = self.sampled.logprob_token_ids.tolist(), self.sampled.logprobs.tolist()
            for row, seq in enumerate(self.seqs):
                n = seq.sampling_params.logprobs
                if n is not None:
                    out.logprobs[seq.seq_id] = dict(zip(ids[row][:n + 1], lps[row][:n + 1]))
        return out


class ModelRunner:

    def __init__(self, config: Config):
        self.config = config
        self.device = torch.device(config.device)
        self.dtype = config.torch_dtype
        self.block_size = config.block_size
        hf_config = config.hf_config
        arch = next(a for a in hf_config.architectures if a in MODEL_REGISTRY)
        torch.manual_seed(config.seed)
        default_dtype = torch.get_default_dtype()
        torch.set_default_dtype(self.dtype)
        try:
            with torch.device(self.device):
                self.model = MODEL_REGISTRY[arch](hf_config, config.max_model_len)
        finally:
            torch.set_default_dtype(default_dtype)
        if config.load_format == "dummy":
            init_dummy_weights(self.model)
        else:
            load_model(self.model, config.model)
        self.sampler = Sampler()
        self.rng = np.random.default_rng(config.seed)   # the seeds of unseeded requests' draws
        self.attn_layers = [m for m in self.model.modules() if isinstance(m, Attention)]
        backend = get_attn_backend(config.attention_backend)
        for layer in self.attn_layers:
            layer.backend = backend
        self.allocate_kv_cache()
        self.prev_sampled_token_ids, self.prev_rows = None, {}   # the last step's samples, still on the device
        self.graph_runner = None
        if self.device.type == "cuda" and not config.enforce_eager:
            self.graph_runner = CUDAGraphRunner(
                self.model, min(config.max_num_seqs, 512), -(-config.max_model_len // self.block_size),
                hf_config.hidden_size, self.dtype, self.device)

    def allocate_kv_cache(self) -> None:
        num_kv_heads, head_dim = self.attn_layers[0].num_kv_heads, self.attn_layers[0].head_dim
        shape = (len(self.attn_layers), self.block_size, num_kv_heads, head_dim)
        block_bytes = 2 * shape[0] * shape[1] * shape[2] * shape[3] * self.dtype.itemsize
        if self.config.num_kvcache_blocks is not None:
            num_blocks = self.config.num_kvcache_blocks
        elif self.device.type == "cpu":
            num_blocks = int(self.config.cpu_kvcache_space_gb * 2**30) // block_bytes
        else:
            num_blocks = int(self.profile_free_memory()) // block_bytes
        if num_blocks * self.block_size < self.config.max_model_len:
            raise ValueError(
                f"the KV cache holds {max(num_blocks, 0) * self.block_size} tokens, fewer than max_model_len="
                f"{self.config.max_model_len}: lower max_model_len or give the cache more memory")
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
            hidden_states = self.model(torch.zeros(num_tokens, dtype=torch.int64, device=self.device), positions)
        rows = min(self.config.max_num_seqs, num_tokens)
        logits = self.model.compute_logits(hidden_states[:rows]).float()
        self.sampler(logits, SamplingMetadata(torch.ones(rows, device=self.device), None,
                                              torch.full((rows,), 0.9, device=self.device), None,
                                              torch.zeros(rows, dtype=torch.int64, device=self.device), False, None))
        torch.cuda.synchronize(self.device)
        peak = torch.cuda.max_memory_allocated(self.device) - before
        del hidden_states, logits
        torch.cuda.empty_cache()
        free, total = torch.cuda.mem_get_info(self.device)
        return total * self.config.gpu_memory_utilization - (total - free) - peak

    def to_device(self, data, dtype: type) -> torch.Tensor:
        """A host list or array as a device tensor: through numpy (torch.tensor(list) costs about a
        microsecond per element) and pinned memory, copied without blocking."""
        tensor = torch.from_numpy(np.asarray(data, dtype=dtype))
        if self.device.type == "cpu":
            return tensor
        return tensor.pin_memory().to(self.device, non_blocking=True)

    def prepare_inputs(self, sched: SchedulerOutput):
        bs = self.block_size
        input_ids, positions, slot_mapping, cu_seqlens_q, context_lens = [], [], [], [0], []
        logits_indices, sample_seqs, placeholders = [], [], []
        for seq, start, num_new, sample in zip(sched.seqs, sched.num_computed_tokens, sched.num_scheduled_tokens,
                                               sched.do_sample):
            end = start + num_new
            if num_new == 1:   # a decode: the common case, kept cheap
                if start < seq.num_tokens:
                    input_ids.append(seq.token_ids[start])
                else:   # the token the previous step is sampling: taken on the device
                    placeholders.append((len(input_ids), self.prev_rows[seq.seq_id]))
                    input_ids.append(0)
                positions.append(start)
                slot_mapping.append(seq.block_table[start // bs] * bs + start % bs)
            else:
                input_ids.extend(seq.token_ids[start:end])
                positions.extend(range(start, end))
                for b in range(start // bs, (end - 1) // bs + 1):
                    base = seq.block_table[b] * bs - b * bs
                    slot_mapping.extend(range(base + max(start, b * bs), base + min(end, (b + 1) * bs)))
            cu_seqlens_q.append(cu_seqlens_q[-1] + num_new)
            context_lens.append(end)
            if sample:
                logits_indices.append(cu_seqlens_q[-1] - 1)
                sample_seqs.append(seq)
        block_tables = np.full((len(sched.seqs), max(len(seq.block_table) for seq in sched.seqs)), -1, np.int32)
        for row, seq in zip(block_tables, sched.seqs):
            row[:len(seq.block_table)] = seq.block_table
        tensor = self.to_device
        meta = AttentionMetadata(
            cu_seqlens_q=tensor(cu_seqlens_q, np.int32), context_lens=tensor(context_lens, np.int32),
            slot_mapping=tensor(slot_mapping, np.int64), block_tables=tensor(block_tables, np.int32),
            max_seqlen_q=max(sched.num_scheduled_tokens))
        input_ids = tensor(input_ids, np.int64)
        if placeholders:
            index, rows = tensor(placeholders, np.int64).unbind(1)
            input_ids[index] = self.prev_sampled_token_ids[rows]
        return input_ids, tensor(positions, np.int64), meta, tensor(logits_indices, np.int64), sample_seqs

    def prepare_sampling(self, seqs: list[Sequence]) -> SamplingMetadata:
        params = [seq.sampling_params for seq in seqs]
        seeds = self.rng.integers(2**63, size=len(seqs))
        for row, seq in enumerate(seqs):
            if seq.sampling_params.seed is not None:   # keyed by the token's index: the same draw in any batch
                index = seq.num_tokens_with_placeholders - seq.num_prompt_tokens
                seeds[row] = hash((seq.sampling_params.seed, index)) & (2**63 - 1)

        def column(values, dtype, neutral):
            return None if all(v == neutral for v in values) else self.to_device(values, dtype)
        num_logprobs = [p.logprobs for p in params if p.logprobs is not None]
        return SamplingMetadata(
            temperatures=self.to_device([p.temperature for p in params], np.float32),
            top_ks=column([p.top_k for p in params], np.int64, 0),
            top_ps=column([p.top_p for p in params], np.float32, 1.0),
            min_ps=column([p.min_p for p in params], np.float32, 0.0),
            seeds=self.to_device(seeds, np.int64), all_greedy=all(p.greedy for p in params),
            max_num_logprobs=max(num_logprobs) if num_logprobs else None)

    def block_stop_tokens(self, logits: torch.Tensor, seqs: list[Sequence]) -> None:
        """Before min_tokens are out, EOS and stop_token_ids cannot be sampled."""
        for row, seq in enumerate(seqs):
            params = seq.sampling_params
            if seq.num_tokens_with_placeholders - seq.num_prompt_tokens - 1 < params.min_tokens:   # this token's index
                blocked = params.stop_token_ids + ([] if params.ignore_eos else self.config.eos_token_ids)
                logits[row, [t for t in blocked if t < logits.shape[1]]] = float("-inf")

    @torch.inference_mode()
    def execute_model(self, sched: SchedulerOutput) -> AsyncModelRunnerOutput:
        """Launch the step and return without waiting for it: on a GPU the host can schedule the
        next step while this one runs."""
        input_ids, positions, meta, logits_indices, seqs = self.prepare_inputs(sched)
        if self.graph_runner is not None and self.graph_runner.can_run(meta, len(input_ids)):
            hidden_states = self.graph_runner.run(input_ids, positions, meta)
        else:
            with set_forward_context(meta):
                hidden_states = self.model(input_ids, positions)
        if not seqs:
            return AsyncModelRunnerOutput([])
        logits = self.model.compute_logits(hidden_states[logits_indices])
        self.block_stop_tokens(logits, seqs)
        sampled = self.sampler(logits, self.prepare_sampling(seqs))
        self.prev_sampled_token_ids = sampled.token_ids
        self.prev_rows = {seq.seq_id: row for row, seq in enumerate(seqs)}
        return AsyncModelRunnerOutput(seqs, sampled)
