"""EAGLE drafts: one small decoder layer that runs ahead on the target's hidden states.

The target's hidden state at position t already knows a lot about the tokens after t + 1. EAGLE
feeds a draft layer with [embedding of token t + 1 ; target hidden state at t], through `fc`
(2H -> H), one Llama decoder layer (without its input norm), and the target's own LM head: out
comes the token at t + 2. Its own output stands in for the hidden state of the next position, so
it can run k steps autoregressively. Its attention reads and writes a KV cache of its own: one
more layer of the engine's paged cache, in the same blocks as the target's.

After every step (the runner, `propose`):
1. one pass over all the step's positions, each fed the token after it (shifted by one; at a
   request's last verified position, the token the step emitted) and the target's hidden state
   there. This writes the draft layer's keys and values for every new position, also of prompt
   chunks, over those the draft's own guesses wrote before. Its output at the last verified
   position gives the first draft;
2. k - 1 more passes of one token per request, each at the next position, from the previous draft
   and the layer's own output. The scheduler gives every request k slots beyond its step for them.

Head folder (the format of the EAGLE-1 checkpoints and vLLM's): a Llama config.json for the
layer (hidden size and heads as the target's) and safetensors with `fc.weight` [H, 2H] (and
`fc.bias` with config `"bias": true`), `layers.0.self_attn.{q,k,v,o}_proj.weight`,
`layers.0.mlp.{gate,up,down}_proj.weight` and `layers.0.post_attention_layernorm.weight`. An
`embed_tokens.weight` there is ignored: the target's embedding is used.
"""
import torch
from torch import nn
from transformers import AutoConfig

from nanoinfer.attention import AttentionMetadata, set_forward_context
from nanoinfer.config import head_dim
from nanoinfer.models.llama import LlamaDecoderLayer, LlamaForCausalLM
from nanoinfer.models.loader import load_model
from nanoinfer.utils import require


class EagleModel(nn.Module):
    packed_modules_mapping = LlamaForCausalLM.packed_modules_mapping
    skipped_weights = ("embed_tokens.weight",)

    def __init__(self, config, max_position: int):
        super().__init__()
        hidden = config.hidden_size
        self.fc = nn.Linear(2 * hidden, hidden, bias=getattr(config, "bias", False))
        self.layers = nn.ModuleList([LlamaDecoderLayer(config, max_position)])
        del self.layers[0].input_layernorm   # its input is fc's output, not normalised

    def forward(self, embeds: torch.Tensor, hidden_states: torch.Tensor,
                positions: torch.Tensor) -> torch.Tensor:
        x = self.fc(torch.cat([embeds, hidden_states], dim=-1))
        layer = self.layers[0]
        h, residual = layer.post_attention_layernorm(layer.self_attn(positions, x), x)
        return layer.mlp(h) + residual


class EagleProposer:

    def __init__(self, path: str, k: int, target: nn.Module, target_config, max_model_len: int,
                 block_size: int, tp_group):
        config = AutoConfig.from_pretrained(path)
        # (heads as the target's, and an MLP that splits over the ranks as the target's does)
        shape, target_shape = ((c.hidden_size, c.num_attention_heads, c.num_key_value_heads,
                                head_dim(c), c.intermediate_size % tp_group.world_size)
                               for c in (config, target_config))
        require(shape == target_shape, f"the EAGLE head in {path!r} has (hidden_size, heads, "
                f"KV heads, head_dim, intermediate_size % tensor_parallel_size) = {shape}, the "
                f"model {target_shape}: they must be equal")
        self.k = k
        self.target = target
        self.max_model_len = max_model_len
        self.block_size = block_size
        self.tp_group = tp_group
        self.model = EagleModel(config, max_model_len + k)
        load_model(self.model, path)

    def modules(self):
        """The draft layer's modules (its attention layer has a KV cache of its own)."""
        return self.model.modules()

    def propose(self, step, hidden_states: torch.Tensor, last_rows: torch.Tensor,
                emitted: torch.Tensor) -> torch.Tensor | None:
        """step: the StepInputs just run; hidden_states: the target's, every position [tokens, H];
        last_rows: each sampling request's last verified position (flat index); emitted: its last
        emitted token. Returns the drafts [requests, k] (on every rank)."""
        # each position's next token
        input_ids = torch.cat([step.input_ids[1:], step.input_ids[-1:]])
        input_ids[step.last_rows] = step.next_token_ids   # a chunk's next prompt token
        input_ids[last_rows] = emitted
        embed = self.target.model.embed_tokens
        with set_forward_context(step.attn_metadata):
            out = self.model(embed(input_ids), hidden_states, step.positions)
        # nobody samples: the pass only wrote the new positions' keys and values
        if not len(last_rows):
            return None
        hidden_states = out[last_rows]
        positions = step.positions[last_rows]
        drafts = []
        while True:
            logits = self.target.compute_logits(hidden_states)   # the first rank's only
            draft = logits.argmax(-1) if logits is not None else \
                torch.empty(len(last_rows), dtype=torch.int64, device=out.device)
            drafts.append(self.tp_group.broadcast(draft))
            if len(drafts) == self.k:
                return torch.stack(drafts, dim=1)
            positions = positions + 1   # the next pass: one position per request
            with set_forward_context(self.decode_metadata(positions, step.sample_block_tables)):
                hidden_states = self.model(embed(draft), hidden_states, positions)

    def decode_metadata(self, positions: torch.Tensor, block_tables: torch.Tensor
                        ) -> AttentionMetadata:
        """One query per request at `positions`; past max_model_len nothing is written or read."""
        inside = positions < self.max_model_len
        positions = positions.clamp(max=self.max_model_len - 1)
        col = (positions // self.block_size).unsqueeze(1)
        bs = self.block_size
        slots = block_tables.gather(1, col).squeeze(1).long() * bs + positions % bs
        cu_seqlens_q = torch.arange(len(positions) + 1, dtype=torch.int32, device=positions.device)
        return AttentionMetadata(
            cu_seqlens_q=cu_seqlens_q, context_lens=(positions + 1).to(torch.int32),
            slot_mapping=torch.where(inside, slots, -1), block_tables=block_tables, max_seqlen_q=1)

