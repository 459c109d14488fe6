"""One decoder for the Llama family: Llama (2, 3, 3.x, SmolLM), Qwen2 and Qwen3.

The three differ in small ways, all read from the config:
- Qwen2 has biases on q/k/v (not on o); Llama and Qwen3 have them only if `attention_bias`.
- Qwen3 RMS-normalizes each query and key head before the rotary embedding.
- `head_dim` may be given explicitly (Qwen3) instead of hidden_size / num_attention_heads.
- Embeddings may be tied to the LM head.

Tokens of all sequences in a step are one flat batch [num_tokens, hidden]: linear layers and
norms do not care which sequence a token belongs to; only attention does, through the metadata.

Under pipeline parallelism each stage builds only its own layers (the others are placeholders, so
that parameter names stay the checkpoint's), the embedding on the first stage, the final norm and
the LM head on the last; a stage's forward takes the previous stage's hidden states and residual
and, on every stage but the last, returns its own for the next.
"""
import torch
from torch import nn

from nanoinfer.config import head_dim, stage_layers
from nanoinfer.distributed import get_pp_group
from nanoinfer.layers.activation import SiluAndMul
from nanoinfer.layers.attention import Attention
from nanoinfer.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from nanoinfer.layers.layernorm import RMSNorm
from nanoinfer.layers.linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from nanoinfer.layers.rotary_embedding import RotaryEmbedding, rope_config


class LlamaAttention(nn.Module):

    def __init__(self, config, max_position: int):
        super().__init__()
        heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
        self.head_dim = dim = head_dim(config)
        is_qwen2 = config.model_type == "qwen2"
        qkv_bias = is_qwen2 or getattr(config, "attention_bias", False)
        o_bias = not is_qwen2 and getattr(config, "attention_bias", False)
        self.qkv_proj = QKVParallelLinear(config.hidden_size, dim, heads, kv_heads, qkv_bias)
        self.num_heads, self.num_kv_heads = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads
        self.o_proj = RowParallelLinear(heads * dim, config.hidden_size, o_bias)
        self.rotary_emb = RotaryEmbedding(dim, max_position, *rope_config(config))
        self.attn = Attention(self.num_heads, dim, dim ** -0.5, self.num_kv_heads)
        self.qk_norm = config.model_type == "qwen3"
        if self.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps)

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor) -> torch.Tensor:
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        q, k, v = self.qkv_proj(hidden_states).split([q_size, kv_size, kv_size], dim=-1)
        q = q.view(-1, self.num_heads, self.head_dim)
        k = k.view(-1, self.num_kv_heads, self.head_dim)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        norms = (self.q_norm, self.k_norm) if self.qk_norm else ()
        q, k = self.rotary_emb(positions, q, k, *norms)
        return self.o_proj(self.attn(q, k, v).flatten(1))


class LlamaMLP(nn.Module):

    def __init__(self, config):
        super().__init__()
        bias = getattr(config, "mlp_bias", False)
        hidden = config.hidden_size
        if (act := config.hidden_act) != "silu":
            raise ValueError(f"hidden_act {act!r} is not supported; nanoinfer supports 'silu'")
        self.gate_up_proj = MergedColumnParallelLinear(hidden, [config.intermediate_size] * 2, bias)
        self.down_proj = RowParallelLinear(config.intermediate_size, hidden, bias)
        self.act_fn = SiluAndMul()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_up_proj(x)))


class LlamaDecoderLayer(nn.Module):

    def __init__(self, config, max_position: int):
        super().__init__()
        self.self_attn = LlamaAttention(config, max_position)
        self.mlp = LlamaMLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, positions, hidden_states, residual):
        if residual is None:
            residual, hidden_states = hidden_states, self.input_layernorm(hidden_states)
        else:
            hidden_states, residual = self.input_layernorm(hidden_states, residual)
        hidden_states = self.self_attn(positions, hidden_states)
        hidden_states, residual = self.post_attention_layernorm(hidden_states, residual)
        return self.mlp(hidden_states), residual


class LlamaModel(nn.Module):

    def __init__(self, config, max_position: int):
        super().__init__()
        pp = get_pp_group()
        vocab = config.vocab_size
        hidden = config.hidden_size
        self.stage = stage_layers(config.num_hidden_layers, pp.world_size, pp.rank_in_group)
        self.embed_tokens = VocabParallelEmbedding(vocab, hidden) if pp.is_first else None
        self.layers = nn.ModuleList(LlamaDecoderLayer(config, max_position) if i in self.stage
                                    else nn.Identity() for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(hidden, config.rms_norm_eps) if pp.is_last else None

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                intermediate: tuple[torch.Tensor, torch.Tensor] | None = None):
        """The final hidden states, or on a stage before the last: (hidden states, residual)."""
        hidden_states, residual = ((self.embed_tokens(input_ids), None) if intermediate is None
                                   else intermediate)
        for layer in self.layers[self.stage.start:self.stage.stop]:
            hidden_states, residual = layer(positions, hidden_states, residual)
        if self.norm is None:
            return hidden_states, residual
        hidden_states, _ = self.norm(hidden_states, residual)
        return hidden_states


class LlamaForCausalLM(nn.Module):
    # checkpoint name -> (our packed parameter, shard id)
    packed_modules_mapping = {
        "q_proj": ("qkv_proj", "q"), "k_proj": ("qkv_proj", "k"), "v_proj": ("qkv_proj", "v"),
        "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}

    def __init__(self, config, max_position: int):
        super().__init__()
        self.model = LlamaModel(config, max_position)
        first, last = self.model.embed_tokens is not None, self.model.norm is not None
        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size) if last else None
        self.tie_word_embeddings = getattr(config, "tie_word_embeddings", False)
        if self.tie_word_embeddings and first and last:
            self.lm_head.weight = self.model.embed_tokens.weight
        # the checkpoint's tensors of other stages are not read (a tied LM head off the first stage
        # reads the embedding's)
        tied_elsewhere = self.tie_word_embeddings and last and not first
        self.skipped_weights = tuple(f"model.layers.{i}." for i in range(config.num_hidden_layers)
                                     if i not in self.model.stage)
        if not first and not tied_elsewhere:
            self.skipped_weights += ("model.embed_tokens.",)
        if not last:
            self.skipped_weights += ("model.norm.", "lm_head.")
        elif self.tie_word_embeddings:   # (tied: the checkpoint's head is the embedding's tensor)
            self.skipped_weights += ("lm_head.weight",)
        self.renamed_weights = (
            {"model.embed_tokens.weight": "lm_head.weight"} if tied_elsewhere else {})

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                intermediate: tuple[torch.Tensor, torch.Tensor] | None = None):
        return self.model(input_ids, positions, intermediate)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden_states)
