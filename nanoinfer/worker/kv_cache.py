"""The paged KV cache on the device: how many blocks fit, and the tensor that holds them.

The cache is one tensor [2 (K, V), layers, blocks, block_size, kv_heads, head_dim]; each
attention layer gets views of its own slice (`k_cache`, `v_cache`). Its number of blocks is
`num_kvcache_blocks` when given; on the CPU, what `cpu_kvcache_space_gb` holds; on a GPU, what is
left of `gpu_memory_utilization` after the weights, the activation peak of a profiling
forward at the largest step (`max_num_batched_tokens` tokens) and the CUDA graphs' memory. Every
rank's cache must hold the blocks the scheduler hands out, so the ranks take the smallest count.
"""
import torch

from nanoinfer.attention import AttentionMetadata, set_forward_context
from nanoinfer.config import Config
from nanoinfer.layers.sampler import SamplingMetadata
from nanoinfer.utils import cdiv, require
from nanoinfer.worker.cuda_graph import max_graph_tokens


def check_kv_cache_holds_max_model_len(config: Config, kv_cache_bytes: float | None,
                                       bytes_per_token: int) -> int:
    """The number of KV cache blocks (from `num_kvcache_blocks`, the CPU's cache space, or
    `kv_cache_bytes`); a ValueError if they cannot hold one sequence of max_model_len tokens."""
    num_blocks = config.num_kvcache_blocks
    if num_blocks is None:
        space = config.cpu_kvcache_space_gb * 2**30 if kv_cache_bytes is None else kv_cache_bytes
        num_blocks = int(space) // (config.block_size * bytes_per_token)
    require(num_blocks * config.block_size >= config.max_model_len,
            f"the KV cache holds {max(num_blocks, 0) * config.block_size} tokens, fewer than "
            f"max_model_len={config.max_model_len}: lower max_model_len or give the cache more "
            "memory")
    return num_blocks


def allocate_kv_cache(layers: list, num_blocks: int, block_size: int, dtype: torch.dtype,
                      device: torch.device) -> torch.Tensor:
    """The KV cache of `num_blocks` blocks for these attention layers, each handed its views."""
    kv_cache = torch.empty(2, len(layers), num_blocks, block_size, layers[0].num_kv_heads,
                           layers[0].head_dim, dtype=dtype, device=device)
    for i, layer in enumerate(layers):
        layer.k_cache, layer.v_cache = kv_cache[:, i]
    return kv_cache


@torch.inference_mode()
def profile_free_memory(runner) -> float:
    """Bytes for the KV cache: run the largest step (without a real cache) and see what is
    left."""
    config = runner.config
    device = runner.device
    layer = runner.attn_layers[0]
    num_tokens = config.max_num_batched_tokens
    max_len = config.max_model_len - 1
    # Sequences of max_model_len - 1 tokens, and one of what is left.
    lens = [max_len] * (num_tokens // max_len)
    if num_tokens % max_len:
        lens.append(num_tokens % max_len)
    # Every key is read from one dummy block, and nothing is written.
    meta = AttentionMetadata(
        cu_seqlens_q=torch.tensor([0] + lens, device=device).cumsum(0).to(torch.int32),
        context_lens=torch.tensor(lens, dtype=torch.int32, device=device),
        slot_mapping=torch.full((num_tokens,), -1, dtype=torch.int64, device=device),
        block_tables=torch.zeros(len(lens), cdiv(max(lens), config.block_size),
                                 dtype=torch.int32, device=device),
        max_seqlen_q=max(lens))
    dummy = torch.zeros(1, config.block_size, layer.num_kv_heads, layer.head_dim,
                        dtype=runner.dtype, device=device)
    for layer in runner.attn_layers:
        layer.k_cache = layer.v_cache = dummy
    torch.cuda.reset_peak_memory_stats(device)
    before = torch.cuda.memory_allocated(device)
    positions = torch.cat([torch.arange(n, device=device) for n in lens])
    with set_forward_context(meta):
        hidden_states = runner.model(torch.zeros(num_tokens, dtype=torch.int64, device=device),
                                     positions, runner.intermediate(num_tokens, torch.zeros))
    # A sequence has k + 1 sample rows when speculating.
    spec = config.speculative
    rows = min(config.max_num_seqs * (1 + (spec.num_speculative_tokens if spec else 0)),
               num_tokens)
    # (ranks other than the last stage's first have no logits)
    logits = runner.model.compute_logits(hidden_states[:rows]) if runner.pp_group.is_last \
        else None
    if logits is not None:
        runner.sampler(logits.float(), SamplingMetadata(
            temperatures=torch.ones(rows, device=device), top_ks=None,
            top_ps=torch.full((rows,), 0.9, device=device), min_ps=None,
            seeds=torch.zeros(rows, dtype=torch.int64, device=device), all_greedy=False,
            max_num_logprobs=None))
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device) - before
    del hidden_states, logits
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info(device)
    # The CUDA graphs, captured later, keep their own pool: the activations of their largest
    # forward, taken as this one's in proportion to the tokens (an overestimate: no logits).
    graphs = 0 if config.enforce_eager else peak * min(1, max_graph_tokens(config) / num_tokens)
    return total * config.gpu_memory_utilization - (total - free) - peak - graphs
