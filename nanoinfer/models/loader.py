"""Loading a Hugging Face checkpoint (*.safetensors) into the model, tensor by tensor.

Checkpoint names are mapped to our parameters: `q_proj`/`k_proj`/`v_proj` go into the packed
`qkv_proj` and `gate_proj`/`up_proj` into `gate_up_proj`, as numbered shards. Each parameter's
own `weight_loader` copies this rank's slice, reading only that slice from the file. A tensor we
have no place for and do not skip (a model's `skipped_weights` are name prefixes), a parameter (or
shard) nobody wrote, or a shape that does not fit is an error: silently random weights are the
worst kind of bug.

`init_dummy_weights` instead fills the model with small random values, for benchmarks:
throughput does not depend on what the weights are.
"""
import glob
import os

from safetensors import safe_open
from torch import nn

from nanoinfer.layers.linear import copy_shard
from nanoinfer.utils import require


def default_weight_loader(param: nn.Parameter, loaded_weight) -> None:
    copy_shard(param.data, loaded_weight)


def load_model(model: nn.Module, path: str) -> None:
    files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
    require(len(files) > 0, f"no *.safetensors weights in {path!r}")
    params = dict(model.named_parameters())
    loaded: dict[str, set] = {name: set() for name in params}
    skipped = getattr(model, "skipped_weights", ())
    for file in files:
        with safe_open(file, framework="pt", device="cpu") as f:
            for name in f.keys():
                # Not read: a buffer some old checkpoints store (recomputed from the config), or
                # what the model does without (a tied LM head's weight, say: the embedding is it).
                if name.endswith("rotary_emb.inv_freq") or name.startswith(skipped):
                    continue
                target, shard_id = getattr(model, "renamed_weights", {}).get(name, name), None
                for ckpt_name, (packed_name, packed_shard) in model.packed_modules_mapping.items():
                    if f".{ckpt_name}." in name:
                        target, shard_id = name.replace(ckpt_name, packed_name), packed_shard
                        break
                param = params.get(target)
                require(param is not None,
                        f"unexpected tensor {name!r} in {file}: the model has no such parameter")
                loader = getattr(param, "weight_loader", default_weight_loader)
                try:
                    tensor = f.get_slice(name)   # read lazily: each rank reads only its part
                    if shard_id is None:
                        loader(param, tensor)
                    else:
                        loader(param, tensor, shard_id)
                except (ValueError, RuntimeError) as e:
                    raise ValueError(f"cannot load tensor {name!r} from {file}: {e}") from e
                loaded[target].add(shard_id)
    for name, param in params.items():
        missing = set(getattr(param, "shard_ids", (None,))) - loaded[name]
        if missing:
            what = name if missing == {None} else f"{name} shards {sorted(missing, key=str)}"
            raise ValueError(f"checkpoint {path!r} is missing weights for {what}")


def init_dummy_weights(model: nn.Module, std: float = 0.02) -> None:
    for name, param in model.named_parameters():
        if "norm" in name:
            param.data.fill_(1.0)
        else:
            param.data.normal_(0.0, std)
