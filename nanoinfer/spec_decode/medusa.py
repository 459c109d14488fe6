"""Medusa drafts: k extra heads that read the target's last hidden state.

The target's LM head turns the hidden state at position t into the token at t + 1. Medusa head i,
trained on the same hidden state, guesses the token at t + 2 + i: a few residual blocks
(x + SiLU(W x + b)) and a vocabulary projection of its own. After a step, the hidden state of the
row that produced the last emitted token goes through every head, and their argmaxes are the next
step's drafts, all at once: no extra forward pass and no KV cache.

Head folder (vLLM's format): config.json with `hidden_size`, `vocab_size`, `num_heads` (or
`medusa_num_heads`), `num_hidden_layers` (or `medusa_num_layers`) and `medusa_fc_bias` (default
false), and safetensors files with, for head i and block j:
    blocks.{i}.layers.{j}.weight   [hidden, hidden]
    blocks.{i}.layers.{j}.bias     [hidden]          (with medusa_fc_bias)
    lm_heads.{i}.weight            [vocab, hidden]
"""
import json
import os

import torch
from torch import nn
from torch.nn import functional as F

from nanoinfer.models.loader import load_model
from nanoinfer.utils import require


class ResidualBlock(nn.Module):

    def __init__(self, hidden_size: int, num_layers: int, bias: bool):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(hidden_size, hidden_size, bias=bias)
                                    for _ in range(num_layers))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = x + F.silu(layer(x))
        return x


class Medusa(nn.Module):
    packed_modules_mapping: dict = {}

    def __init__(self, path: str, k: int, hidden_size: int, vocab_size: int):
        super().__init__()
        config = read_config(path)
        num_heads = config.get("num_heads", config.get("medusa_num_heads"))
        num_layers = config.get("num_hidden_layers", config.get("medusa_num_layers", 1))
        require((config.get("hidden_size"), config.get("vocab_size")) == (hidden_size, vocab_size),
                f"the Medusa heads in {path!r} are for hidden_size={config.get('hidden_size')}, "
                f"vocab_size={config.get('vocab_size')}; the model has {hidden_size}, {vocab_size}")
        require(isinstance(num_heads, int) and num_heads >= k,
                f"num_speculative_tokens={k} needs {k} Medusa heads; {path!r} has {num_heads}")
        bias = config.get("medusa_fc_bias", False)
        self.blocks = nn.ModuleList(ResidualBlock(hidden_size, num_layers, bias) for _ in range(k))
        self.lm_heads = nn.ModuleList(nn.Linear(hidden_size, vocab_size, bias=False)
                                      for _ in range(k))
        self.skipped_weights = tuple(f"{m}.{i}." for i in range(k, num_heads)
                                     for m in ("blocks", "lm_heads"))
        load_model(self, path)   # the names above are the checkpoint's; heads beyond k are skipped

    def propose(self, step, hidden_states: torch.Tensor, last_rows: torch.Tensor,
                emitted: torch.Tensor) -> torch.Tensor:
        """hidden_states: the target's [tokens, hidden]; last_rows: the sampling requests' last
        emitted positions -> drafts int64 [requests, k] (the step and its tokens are not needed)."""
        last = hidden_states[last_rows]
        return torch.stack([lm_head(block(last)).argmax(-1)
                            for block, lm_head in zip(self.blocks, self.lm_heads)], dim=1)


def read_config(path: str) -> dict:
    try:
        with open(os.path.join(path, "config.json")) as f:
            return json.load(f)
    except (OSError, ValueError) as e:
        raise ValueError(f"cannot read the draft head's config.json in {path!r}: {e}") from e
