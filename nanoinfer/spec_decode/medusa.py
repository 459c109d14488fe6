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
import glob
import json
import os

import torch
from safetensors.torch import load_file
from torch import nn
from torch.nn import functional as F


class MedusaHead(nn.Module):

    def __init__(self, hidden_size: int, vocab_size: int, num_layers: int, bias: bool):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(hidden_size, hidden_size, bias=bias) for _ in range(num_layers))
        self.lm_head = nn.Linear(hidden_size, vocab_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = x + F.silu(layer(x))
        return self.lm_head(x)


class Medusa(nn.Module):

    def __init__(self, path: str, k: int, hidden_size: int, vocab_size: int):
        super().__init__()
        config = read_config(path)
        num_heads = config.get("num_heads", config.get("medusa_num_heads"))
        num_layers = config.get("num_hidden_layers", config.get("medusa_num_layers", 1))
        if (config.get("hidden_size"), config.get("vocab_size")) != (hidden_size, vocab_size):
            raise ValueError(f"the Medusa heads in {path!r} are for hidden_size={config.get('hidden_size')}, "
                             f"vocab_size={config.get('vocab_size')}; the model has {hidden_size}, {vocab_size}")
        if not isinstance(num_heads, int) or num_heads < k:
            raise ValueError(f"num_speculative_tokens={k} needs {k} Medusa heads; {path!r} has {num_heads}")
        self.heads = nn.ModuleList(MedusaHead(hidden_size, vocab_size, num_layers, config.get("medusa_fc_bias", False))
                                   for _ in range(k))
        weights = {}
        for file in sorted(glob.glob(os.path.join(path, "*.safetensors"))):
            weights.update(load_file(file))
        for i, head in enumerate(self.heads):
            names = {f"layers.{j}.{p}": f"blocks.{i}.layers.{j}.{p}" for j in range(num_layers) for p in ("weight", "bias")}
            names["lm_head.weight"] = f"lm_heads.{i}.weight"
            for name, param in head.named_parameters():
                if names[name] not in weights:
                    raise ValueError(f"the Medusa heads in {path!r} lack {names[name]}")
                loaded = weights[names[name]]
                if loaded.shape != param.shape:
                    raise ValueError(f"{names[name]} in {path!r} has shape {list(loaded.shape)}, "
                                     f"expected {list(param.shape)}")
                param.data.copy_(loaded)

    def propose(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """hidden_states: [seqs, hidden] -> drafts int64 [seqs, k]."""
        return torch.stack([head(hidden_states).argmax(-1) for head in self.heads], dim=1)


def read_config(path: str) -> dict:
    try:
        with open(os.path.join(path, "config.json")) as f:
            return json.load(f)
    except (OSError, ValueError) as e:
        raise ValueError(f"cannot read the draft head's config.json in {path!r}: {e}") from e
