"""CUDA graphs for pure-decode steps.

A decode step of a small model is hundreds of tiny kernel launches; launched one by one from
Python, the GPU would wait on the CPU. A CUDA graph records the whole forward once and replays
it with one launch. A graph has fixed shapes and fixed addresses, so:
- forwards are captured for a ladder of batch sizes (1, 2, 4, 8, then every 16 up to the
  largest), largest first, all sharing one memory pool;
- every input lives in a static buffer, copied in before each replay; a batch of n runs the
  smallest graph of at least n, and the padding rows write nowhere (slot -1) and attend to
  nothing (context length 0);
- the block-table buffer is as wide as the longest sequence (max_model_len) can need;
- a pipeline stage's graphs also read the previous stage's hidden states and residual from static
  buffers, and on every stage but the last leave their own in two more.
"""
import torch

from nanoinfer.attention import AttentionMetadata, set_forward_context
from nanoinfer.config import Config
from nanoinfer.utils import cdiv


class CUDAGraphRunner:

    def __init__(self, model: torch.nn.Module, config: Config, device: torch.device,
                 first_stage: bool = True, last_stage: bool = True):
        max_batch_size = min(config.max_num_seqs, 512)
        sizes = [1, 2, 4, 8, *range(16, max_batch_size + 1, 16), max_batch_size]
        self.batch_sizes = sorted({b for b in sizes if b <= max_batch_size})
        n, hidden, dtype = self.batch_sizes[-1], config.hf_config.hidden_size, config.torch_dtype

        def zeros(*shape, dtype=torch.int32):
            return torch.zeros(*shape, dtype=dtype, device=device)
        self.input_ids, self.positions = zeros(n, dtype=torch.int64), zeros(n, dtype=torch.int64)
        self.slot_mapping = torch.full((n,), -1, dtype=torch.int64, device=device)
        self.context_lens = zeros(n)
        self.block_tables = zeros(n, cdiv(config.max_model_len, config.block_size))
        self.cu_seqlens_q = torch.arange(n + 1, dtype=torch.int32, device=device)

        def hidden_states(count: int) -> tuple[torch.Tensor, ...]:
            return tuple(zeros(n, hidden, dtype=dtype) for _ in range(count))
        # the previous stage's hidden states and residual; the output (a stage's: both of its own)
        self.intermediate = None if first_stage else hidden_states(2)
        self.outputs = hidden_states(1 if last_stage else 2)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        pool = None
        for bs in reversed(self.batch_sizes):
            meta = self.metadata(bs)
            with set_forward_context(meta):
                self.forward(model, bs)   # warm-up, compiles
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool):
                    self.forward(model, bs)
            pool = graph.pool()
            self.graphs[bs] = graph
        torch.cuda.synchronize()

    def forward(self, model: torch.nn.Module, bs: int) -> None:
        intermediate = None if self.intermediate is None else [t[:bs] for t in self.intermediate]
        out = model(self.input_ids[:bs], self.positions[:bs], intermediate)
        for buffer, t in zip(self.outputs, out if isinstance(out, tuple) else (out,)):
            buffer[:bs] = t

    def metadata(self, bs: int) -> AttentionMetadata:
        return AttentionMetadata(
            cu_seqlens_q=self.cu_seqlens_q[:bs + 1], context_lens=self.context_lens[:bs],
            slot_mapping=self.slot_mapping[:bs], block_tables=self.block_tables[:bs],
            max_seqlen_q=1)

    def can_run(self, meta: AttentionMetadata, num_tokens: int) -> bool:
        return meta.max_seqlen_q == 1 and num_tokens <= self.batch_sizes[-1]

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
            intermediate: tuple[torch.Tensor, torch.Tensor] | None = None):
        n = input_ids.shape[0]
        bs = next(b for b in self.batch_sizes if b >= n)
        self.input_ids[:n] = input_ids
        self.positions[:n] = positions
        self.slot_mapping[:n] = meta.slot_mapping
        self.slot_mapping[n:bs] = -1
        self.context_lens[:n] = meta.context_lens
        self.context_lens[n:bs] = 0
        self.block_tables[:n, :meta.block_tables.shape[1]] = meta.block_tables
        for buffer, t in zip(self.intermediate or (), intermediate or ()):
            buffer[:n] = t
        self.graphs[bs].replay()
        return self.outputs[0][:n] if len(self.outputs) == 1 else tuple(t[:n] for t in self.outputs)
