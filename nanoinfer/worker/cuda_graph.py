"""CUDA graphs for decode steps and small prefill steps.

A decode step of a small model is hundreds of tiny kernel launches; launched one by one from
Python, the GPU would wait on the CPU. A prompt's prefill is the same launches on more tokens: for
a prompt of a few hundred tokens the host's launching takes longer than the GPU's work, and the
time to the first token is the host's. A CUDA graph records the whole forward once and replays it
with one launch. A graph has fixed shapes and fixed addresses, so:
- forwards are captured for a ladder of sizes, largest first, all sharing one memory pool:
  decode steps (one query per sequence) of 1, 2, 4, 8, then every 16 up to the largest batch;
  prefill steps (any mix of prompt chunks and decodes) of 128 up to 4096 tokens (up to
  `max_num_batched_tokens`) and at most `PREFILL_SEQS` sequences;
- every input lives in a static buffer, copied in before each replay; a step runs the smallest
  graph that holds it, and the padding writes nowhere (slot -1) and attends to nothing: padding
  rows of a decode graph have context length 0, padding tokens of a prefill graph belong to no
  sequence, and its padding sequences have no queries;
- the prefill attention kernel's launch depends only on the token and sequence counts
  (kernels/prefill_attention.py), which is what lets a graph hold it;
- the block-table buffer is as wide as the longest sequence (max_model_len) can need;
- a pipeline stage's graphs also read the previous stage's hidden states and residual from static
  buffers, and on every stage but the last leave their own in two more.
The graphs' memory (the activations of the largest, 4096 tokens at most, in a pool of their own)
is set aside before the KV cache is sized (kv_cache.py). Other steps run eagerly.
"""
import torch

from nanoinfer.attention import AttentionMetadata, set_forward_context
from nanoinfer.config import Config
from nanoinfer.utils import cdiv


PREFILL_TOKENS = (128, 256, 384, 512, 768, 1024, 1536, 2048, 3072, 4096)
PREFILL_SEQS = 16


def graph_sizes(config: Config) -> tuple[list[int], list[int]]:
    """The batch sizes of the decode graphs, and the token counts of the prefill graphs."""
    max_batch_size = min(config.max_num_seqs, 512)
    sizes = [1, 2, 4, 8, *range(16, max_batch_size + 1, 16), max_batch_size]
    return sorted({b for b in sizes if b <= max_batch_size}), \
        [t for t in PREFILL_TOKENS if t <= config.max_num_batched_tokens]


def max_graph_tokens(config: Config) -> int:
    """The most tokens any graph holds (the static buffers' length)."""
    decode_sizes, prefill_sizes = graph_sizes(config)
    return max([decode_sizes[-1], *prefill_sizes])


class CUDAGraphRunner:

    def __init__(self, model: torch.nn.Module, config: Config, device: torch.device,
                 first_stage: bool = True, last_stage: bool = True):
        self.batch_sizes, self.prefill_sizes = graph_sizes(config)
        n = max_graph_tokens(config)
        seqs = max(self.batch_sizes[-1], PREFILL_SEQS)
        hidden = config.hf_config.hidden_size
        dtype = config.torch_dtype

        def zeros(*shape, dtype=torch.int32):
            return torch.zeros(*shape, dtype=dtype, device=device)
        self.input_ids, self.positions = zeros(n, dtype=torch.int64), zeros(n, dtype=torch.int64)
        self.slot_mapping = torch.full((n,), -1, dtype=torch.int64, device=device)
        self.context_lens = zeros(seqs)
        self.block_tables = zeros(seqs, cdiv(config.max_model_len, config.block_size))
        # a decode step's query ranges never change; a prefill step's are copied in
        self.cu_seqlens_q = torch.arange(seqs + 1, dtype=torch.int32, device=device)
        self.prefill_cu_seqlens_q = zeros(PREFILL_SEQS + 1)

        def hidden_states(count: int) -> tuple[torch.Tensor, ...]:
            return tuple(zeros(n, hidden, dtype=dtype) for _ in range(count))
        # the previous stage's hidden states and residual; the output (a stage's: both of its own)
        self.intermediate = None if first_stage else hidden_states(2)
        self.outputs = hidden_states(1 if last_stage else 2)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.prefill_graphs: dict[int, torch.cuda.CUDAGraph] = {}
        pool = None
        ladder = [(bs, True) for bs in self.batch_sizes] + [(t, False) for t in self.prefill_sizes]
        for size, decode in sorted(ladder, reverse=True):
            with set_forward_context(self.metadata(size, decode)):
                self.forward(model, size)   # warm-up, compiles
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool):
                    self.forward(model, size)
            pool = graph.pool()
            (self.graphs if decode else self.prefill_graphs)[size] = graph
        torch.cuda.synchronize()

    def forward(self, model: torch.nn.Module, size: int) -> None:
        intermediate = None if self.intermediate is None else [t[:size] for t in self.intermediate]
        out = model(self.input_ids[:size], self.positions[:size], intermediate)
        for buffer, t in zip(self.outputs, out if isinstance(out, tuple) else (out,)):
            buffer[:size] = t

    def metadata(self, size: int, decode: bool) -> AttentionMetadata:
        """A graph's view of the buffers: `size` tokens, and as many sequences (decode) or
        PREFILL_SEQS (prefill; max_seqlen_q = size only chooses the kernel's tile)."""
        seqs = size if decode else PREFILL_SEQS
        cu_seqlens_q = self.cu_seqlens_q[:size + 1] if decode else self.prefill_cu_seqlens_q
        return AttentionMetadata(
            cu_seqlens_q=cu_seqlens_q, context_lens=self.context_lens[:seqs],
            slot_mapping=self.slot_mapping[:size], block_tables=self.block_tables[:seqs],
            max_seqlen_q=1 if decode else size)

    def graph_size(self, meta: AttentionMetadata, num_tokens: int) -> tuple[int, bool] | None:
        """(size, decode) of the smallest graph that holds the step; None: none does."""
        if meta.max_seqlen_q == 1 and num_tokens <= self.batch_sizes[-1]:
            return next(b for b in self.batch_sizes if b >= num_tokens), True
        if self.prefill_sizes and num_tokens <= self.prefill_sizes[-1] \
                and len(meta.context_lens) <= PREFILL_SEQS:
            return next(t for t in self.prefill_sizes if t >= num_tokens), False
        return None

    def run(self, graph: tuple[int, bool], input_ids: torch.Tensor, positions: torch.Tensor,
            meta: AttentionMetadata, intermediate: tuple[torch.Tensor, torch.Tensor] | None = None):
        """Replays the graph `graph_size` chose for this step, its inputs copied in first."""
        size, decode = graph
        n = len(input_ids)
        s = len(meta.context_lens)
        self.input_ids[:n] = input_ids
        self.positions[:n] = positions
        self.slot_mapping[:n] = meta.slot_mapping
        self.slot_mapping[n:size] = -1
        self.context_lens[:s] = meta.context_lens
        self.context_lens[s:size if decode else PREFILL_SEQS] = 0
        self.block_tables[:s, :meta.block_tables.shape[1]] = meta.block_tables
        if not decode:   # the padding sequences: no queries
            self.prefill_cu_seqlens_q[:s + 1] = meta.cu_seqlens_q
            self.prefill_cu_seqlens_q[s + 1:] = n
        for buffer, t in zip(self.intermediate or (), intermediate or ()):
            buffer[:n] = t
        (self.graphs if decode else self.prefill_graphs)[size].replay()
        return self.outputs[0][:n] if len(self.outputs) == 1 else tuple(t[:n] for t in self.outputs)
