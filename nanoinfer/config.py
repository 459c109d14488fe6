"""Engine configuration.

`Config` gathers every knob of the engine in one dataclass (names follow vLLM's engine
arguments) and the model's own Hugging Face config, read through `AutoConfig`. It checks what
can be checked before anything is allocated: that the model folder exists and describes an
architecture this engine implements, and that the sizes are consistent.
"""
import os
from dataclasses import dataclass, field

import torch
from transformers import AutoConfig, GenerationConfig, PretrainedConfig

from nanoinfer.utils import check_int, is_int, require

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM")
ALLOW_LONG = "NANOINFER_ALLOW_LONG_MAX_MODEL_LEN"


@dataclass
class Config:
    model: str
    max_num_batched_tokens: int = 8192   # token budget of one scheduler step
    max_num_seqs: int = 256              # sequences in one step at most
    max_model_len: int | None = None     # prompt + output tokens; default: the model's context
    gpu_memory_utilization: float = 0.9  # share of GPU memory for weights, activations, KV cache
    cpu_kvcache_space_gb: float = 1.0    # KV cache size when running on the CPU
    num_kvcache_blocks: int | None = None  # overrides the computed KV cache size
    block_size: int = 16
    enable_prefix_caching: bool = True
    tensor_parallel_size: int = 1
    # stages, each a contiguous range of layers (P steps in flight)
    pipeline_parallel_size: int = 1
    enforce_eager: bool = False          # no CUDA graphs
    async_scheduling: bool = True        # schedule step N+1 while step N runs
    dtype: str = "auto"                  # auto: float32 on CPU, the checkpoint's dtype on GPU
    device: str = "auto"                 # auto: cuda if available, else cpu
    attention_backend: str = "auto"      # auto: triton on cuda, torch on cpu
    seed: int = 0
    max_logprobs: int = 20               # the most top-N logprobs a request may ask for
    load_format: str = "auto"            # "dummy": random weights, only config.json is read
    skip_tokenizer_init: bool = False    # prompts are token ids, outputs carry no text
    speculative_config: dict | None = None   # vLLM's keys: see SpeculativeConfig
    kv_transfer_config: dict | None = None   # vLLM's keys: see KVTransferConfig
    # several nodes (executor/multinode.py), meeting at the head's master_addr:master_port
    nnodes: int = 1
    node_rank: int = 0
    master_addr: str = "127.0.0.1"
    master_port: int | None = None       # None: a free port (one node only)
    event_log: str | None = None         # a file for the core's event log (engine/event_log.py)
    speculative: "SpeculativeConfig | None" = field(init=False, default=None)
    kv_transfer: "KVTransferConfig | None" = field(init=False, default=None)
    hf_config: PretrainedConfig = field(init=False, repr=False)
    eos_token_ids: list[int] = field(init=False)

    def __post_init__(self):
        self.hf_config = load_hf_config(self.model)
        if not os.path.isdir(self.model):   # a hub id (where a hub is reachable): fetch it once
            self.model = download(self.model, self.load_format)
        self.eos_token_ids = load_eos_token_ids(self.model, self.hf_config)
        if self.device == "auto":
            self.device = "cuda" if torch.cuda.is_available() else "cpu"
        if self.attention_backend == "auto":
            self.attention_backend = "triton" if self.device == "cuda" else "torch"
        model_len = getattr(self.hf_config, "max_position_embeddings", None) or 4096
        if self.max_model_len is None:
            self.max_model_len = model_len
        self.check_ranges()
        require(self.max_model_len <= model_len or os.environ.get(ALLOW_LONG) == "1",
                f"max_model_len={self.max_model_len} is longer than the model's context "
                f"(max_position_embeddings={model_len}): outputs past it are likely wrong. Set "
                f"{ALLOW_LONG}=1 to allow it anyway")
        self.check_nodes()
        if self.world_size > 1:
            self.check_model_parallel()
        if self.speculative_config is not None:
            require(self.pipeline_parallel_size == 1,
                    "speculative decoding does not work with pipeline parallelism yet")
            self.speculative = SpeculativeConfig.from_dict(self.speculative_config)
            # the next step's drafts need this step's tokens on the host
            self.async_scheduling = False
        if self.kv_transfer_config is not None:
            self.kv_transfer = KVTransferConfig.from_dict(self.kv_transfer_config)

    def check_ranges(self) -> None:
        """Each number in its range, or a ValueError naming it."""
        for name in ("max_num_batched_tokens", "max_num_seqs", "max_model_len", "block_size",
                     "tensor_parallel_size", "pipeline_parallel_size"):
            check_int(name, getattr(self, name), 1)
        check_int("max_logprobs", self.max_logprobs, 0)
        blocks = self.num_kvcache_blocks
        require(blocks is None or is_int(blocks, 1),
                f"num_kvcache_blocks must be None or an integer >= 1, got {blocks!r}")
        require(0 < self.gpu_memory_utilization <= 1, "gpu_memory_utilization must be in (0, 1], "
                f"got {self.gpu_memory_utilization!r}")
        require(self.load_format in ("auto", "dummy"),
                f"load_format must be 'auto' or 'dummy', got {self.load_format!r}")

    @property
    def world_size(self) -> int:
        return self.tensor_parallel_size * self.pipeline_parallel_size

    @property
    def node_ranks(self) -> range:
        """The ranks this node runs: node n the n-th of `nnodes` equal parts (whole stages)."""
        per_node = self.world_size // self.nnodes
        return range(self.node_rank * per_node, (self.node_rank + 1) * per_node)

    @property
    def driver_rank(self) -> int:
        """The rank that samples and sends the outputs: the last stage's first."""
        return self.world_size - self.tensor_parallel_size

    def check_model_parallel(self) -> None:
        """The model's sizes must split evenly over the tensor-parallel ranks (KV heads may be
        replicated), and each pipeline stage must get at least one layer."""
        tp = self.tensor_parallel_size
        pp = self.pipeline_parallel_size
        hf = self.hf_config
        require(pp <= hf.num_hidden_layers, f"pipeline_parallel_size={pp} is more than the "
                f"model's num_hidden_layers={hf.num_hidden_layers}")
        for name, size in (("num_attention_heads", hf.num_attention_heads),
                           ("intermediate_size", getattr(hf, "intermediate_size", 0))):
            require(size % tp == 0,
                    f"tensor_parallel_size={tp} does not divide the model's {name}={size}")
        kv_heads = hf.num_key_value_heads
        require(kv_heads % tp == 0 or tp % kv_heads == 0, f"tensor_parallel_size={tp} neither "
                f"divides nor is a multiple of the model's num_key_value_heads={kv_heads}")
        gpus = torch.cuda.device_count()
        per_node = self.world_size // self.nnodes
        require(self.device != "cuda" or gpus >= per_node, f"tensor_parallel_size={tp} x "
                f"pipeline_parallel_size={pp} over nnodes={self.nnodes} needs {per_node} GPUs "
                f"on each node, this one has {gpus}")

    def check_nodes(self) -> None:
        """The ranks split evenly over the nodes, each tensor-parallel group inside one."""
        n = self.nnodes
        require(is_int(n, 1) and is_int(self.node_rank, 0, n - 1), f"nnodes must be an integer "
                f">= 1 and node_rank one in [0, nnodes), got {n!r} and {self.node_rank!r}")
        # (whole stages to a node: a tensor-parallel group's all-reduce in every layer needs a
        # node's own links, a stage boundary only one send a step)
        require(self.pipeline_parallel_size % n == 0, f"nnodes={n} must divide pipeline_parallel_"
                f"size={self.pipeline_parallel_size}: each node holds whole pipeline stages")
        require(is_int(self.master_port, 1, 65534) if n > 1 else self.master_port is None,
                f"master_port: the head's if nnodes > 1, else None; got {self.master_port!r}")

    @property
    def num_lookahead_tokens(self) -> int:
        """Slots past a step that EAGLE's drafts write (0 without EAGLE)."""
        spec = self.speculative
        return spec.num_speculative_tokens if spec is not None and spec.method == "eagle" else 0

    def kv_cache_bytes_per_token(self, stage: int | None = None) -> int:
        """The keys and values of one token on one rank, in every layer of pipeline stage `stage`
        (None: of the largest stage)."""
        hf = self.hf_config
        # (a KV head is replicated where there are more ranks than heads)
        num_kv_heads = max(1, hf.num_key_value_heads // self.tensor_parallel_size)
        pp = self.pipeline_parallel_size
        stages = range(pp) if stage is None else [stage]
        num_layers = max(len(stage_layers(hf.num_hidden_layers, pp, s)) for s in stages)
        if self.num_lookahead_tokens:   # EAGLE's draft layer
            num_layers += 1
        return 2 * num_layers * num_kv_heads * head_dim(hf) * self.torch_dtype.itemsize

    @property
    def torch_dtype(self) -> torch.dtype:
        if self.dtype != "auto":
            return getattr(torch, self.dtype)
        if self.device == "cpu":
            return torch.float32
        hf = self.hf_config
        dtype = getattr(hf, "dtype", None) or getattr(hf, "torch_dtype", None)
        if isinstance(dtype, str):
            dtype = getattr(torch, dtype)
        return torch.bfloat16 if dtype in (None, torch.float32) else dtype


@dataclass
class SpeculativeConfig:
    """`speculative_config={"method": ..., "num_speculative_tokens": k, ...}`, vLLM's keys. n-gram
    looks up the last `prompt_lookup_max` down to `prompt_lookup_min` tokens (both 5 when neither
    is given, the other's value when one is); EAGLE and Medusa read a draft head from `model`."""
    method: str
    num_speculative_tokens: int
    prompt_lookup_max: int | None = None
    prompt_lookup_min: int | None = None
    model: str | None = None

    @classmethod
    def from_dict(cls, d: dict) -> "SpeculativeConfig":
        require(isinstance(d, dict), f"speculative_config must be a dict, got {type(d).__name__}")
        known = sorted(cls.__dataclass_fields__)
        unknown = sorted(set(d) - set(known))
        require(not unknown, f"speculative_config has unknown keys {unknown}; known: {known}")
        for key in ("method", "num_speculative_tokens"):
            require(key in d, f"speculative_config needs {key!r}")
        spec = cls(**d)
        require(spec.method in ("ngram", "eagle", "medusa"), "speculative_config method must be "
                f"'ngram', 'eagle' or 'medusa', got {spec.method!r}")
        k = spec.num_speculative_tokens
        require(is_int(k, 1) and k <= 32,
                f"num_speculative_tokens must be an integer in [1, 32], got {k!r}")
        if spec.method != "ngram":
            require(spec.prompt_lookup_max is None and spec.prompt_lookup_min is None,
                    f"prompt_lookup_min/max are for ngram, not {spec.method}")
            require(isinstance(spec.model, str) and os.path.isdir(spec.model), f"{spec.method} "
                    f"needs 'model': a folder with the draft head, got {spec.model!r}")
            return spec
        require(spec.model is None,
                "speculative_config: 'model' is for eagle and medusa, not ngram")
        if spec.prompt_lookup_max is None:
            spec.prompt_lookup_max = 5 if spec.prompt_lookup_min is None else spec.prompt_lookup_min
        if spec.prompt_lookup_min is None:
            spec.prompt_lookup_min = spec.prompt_lookup_max
        for key in ("prompt_lookup_max", "prompt_lookup_min"):
            check_int(key, getattr(spec, key), 1)
        require(spec.prompt_lookup_min <= spec.prompt_lookup_max, f"prompt_lookup_min="
                f"{spec.prompt_lookup_min} is more than prompt_lookup_max={spec.prompt_lookup_max}")
        return spec


@dataclass
class KVTransferConfig:
    """`kv_transfer_config={"kv_connector": ..., "kv_role": ..., "kv_connector_extra_config":
    {...}}`, vLLM's keys (kv_transfer/): SharedStorageConnector, with "shared_storage_path"."""
    kv_connector: str
    kv_role: str
    extra_config: dict

    @classmethod
    def from_dict(cls, d: dict) -> "KVTransferConfig":
        keys = {"kv_connector", "kv_role", "kv_connector_extra_config"}
        require(isinstance(d, dict) and not set(d) - keys, "kv_transfer_config must be a dict of "
                f"kv_connector, kv_role and kv_connector_extra_config, got {d!r}")
        spec = cls(d.get("kv_connector"), d.get("kv_role"),
                   d.get("kv_connector_extra_config") or {})
        require(spec.kv_connector == "SharedStorageConnector", "kv_connector must be "
                f"'SharedStorageConnector', got {spec.kv_connector!r}")
        roles = ["kv_producer", "kv_consumer", "kv_both"]
        require(spec.kv_role in roles, f"kv_role must be one of {roles}, got {spec.kv_role!r}")
        require(isinstance(spec.extra_config.get("shared_storage_path"), str),
                "SharedStorageConnector needs kv_connector_extra_config['shared_storage_path'], "
                "a str")
        return spec


def head_dim(hf: PretrainedConfig) -> int:
    """A model's attention head size: given (Qwen3), or hidden_size / num_attention_heads."""
    return getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads


def stage_layers(num_layers: int, pipeline_parallel_size: int, stage: int) -> range:
    """The layers of a pipeline stage: an even split, the remainder going to the stages before
    the last (which also holds the final norm and the LM head). 7 layers in 3 stages: 2, 3, 2."""
    sizes = [num_layers // pipeline_parallel_size] * pipeline_parallel_size
    for i in range(num_layers % pipeline_parallel_size):
        sizes[-2 - i] += 1
    return range(sum(sizes[:stage]), sum(sizes[:stage + 1]))


def download(model: str, load_format: str) -> str:
    """A hub model's folder, fetched once (its weights too, unless they are to be random)."""
    from huggingface_hub import snapshot_download
    patterns = ["*.json", "*.model", "*.txt", "*.jinja"]
    if load_format == "auto":
        patterns.append("*.safetensors")
    return snapshot_download(model, allow_patterns=patterns)


def load_hf_config(model: str) -> PretrainedConfig:
    require(not os.path.isdir(model) or os.path.isfile(os.path.join(model, "config.json")),
            f"model folder {model!r} has no config.json")
    require(not os.path.isfile(model),
            f"model {model!r} is a file; pass the folder that holds config.json")
    try:
        hf_config = AutoConfig.from_pretrained(model)
    except Exception as e:   # transformers raises many kinds for a bad config.json
        if os.path.isdir(model):
            raise ValueError(f"malformed config in {model!r}: {e}") from e
        raise ValueError(f"cannot load model {model!r}: no such local folder, and no model of "
                         f"that name could be fetched from a hub ({e.__class__.__name__})") from e
    archs = getattr(hf_config, "architectures", None) or []
    require(any(a in SUPPORTED_ARCHITECTURES for a in archs), f"model {model!r} has architecture "
            f"{archs or 'unknown'}; nanoinfer supports {', '.join(SUPPORTED_ARCHITECTURES)}")
    for name in ("hidden_size", "num_hidden_layers", "num_attention_heads", "vocab_size"):
        require(isinstance(getattr(hf_config, name, None), int),
                f"malformed config for model {model!r}: {name} is missing or not an integer")
    return hf_config


def load_eos_token_ids(model: str, hf_config: PretrainedConfig) -> list[int]:
    """EOS ids from generation_config.json (which may list several), else from config.json."""
    try:
        eos = GenerationConfig.from_pretrained(model).eos_token_id
    except (OSError, ValueError):
        eos = None
    if eos is None:
        eos = getattr(hf_config, "eos_token_id", None)
    return [eos] if isinstance(eos, int) else list(eos or ())
