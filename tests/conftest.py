"""Shared fixtures: tiny random models of each family, saved as Hugging Face folders.

Every model test compares nanoinfer with transformers itself, in float32 on the CPU. The
models are random (no weights can be downloaded here); the tokenizer is a small byte-level BPE
trained on the spot, so multi-byte characters really do span several tokens.
"""
import functools
import gc
import json
import os
import shutil

# One torch (OpenMP) thread in each test process and in the processes tests start (servers,
# engine cores, course checks), which inherit it. On a machine of a few cores those processes
# run side by side, and OpenMP threads that spin waiting for a core another process holds cost
# several times the work: tests/test_engine.py took 52 s of CPU time with torch's default (a
# thread per core) against 11 s with one. The tiny models here gain nothing from more threads.
os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402

torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))   # (if torch was imported before)

if not torch.cuda.is_available():   # Triton kernels run under the interpreter on the CPU
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import (AutoModelForCausalLM, GenerationConfig, LlamaConfig, PreTrainedTokenizerFast,
                          Qwen2Config, Qwen3Config)

VOCAB_SIZE = 512
CORPUS = ["The quick brown fox jumps over the lazy dog. " * 3, "Hello world! Héllo wörld, ça va? 日本語のテキスト 🙂",
          "Inference engines batch requests, cache keys and values, and sample tokens."] * 20
CHAT_TEMPLATE = ("{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}assistant:{% endif %}")


def make_tokenizer() -> PreTrainedTokenizerFast:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["<unk>", "<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(CORPUS, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>")
    fast.chat_template = CHAT_TEMPLATE
    return fast


def tiny_config(family: str, **overrides):
    common = dict(vocab_size=VOCAB_SIZE, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                  bos_token_id=1, eos_token_id=2, initializer_range=0.2)
    common.update(overrides)
    if family == "llama":   # Llama 3 rope scaling, untied embeddings
        return LlamaConfig(**common, tie_word_embeddings=False, rope_theta=500000.0,
                           rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                         "high_freq_factor": 4.0, "original_max_position_embeddings": 64})
    if family == "qwen2":   # q/k/v bias, tied embeddings
        return Qwen2Config(**common, tie_word_embeddings=True)
    if family == "qwen3":   # per-head q/k RMSNorm, explicit head_dim different from hidden/heads
        return Qwen3Config(**common, head_dim=32, tie_word_embeddings=False)
    raise ValueError(family)


def save_model(family: str, path: str, **overrides) -> str:
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_config(family, **overrides), dtype=torch.float32)
    if family == "qwen2":   # random biases, so a dropped bias would show
        for layer in model.model.layers:
            for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                torch.nn.init.normal_(proj.bias, std=0.2)
    model.save_pretrained(path)
    make_tokenizer().save_pretrained(path)
    GenerationConfig(bos_token_id=1, eos_token_id=2).save_pretrained(path)
    return path


@pytest.fixture(autouse=True)
def engine_on_cpu_unless_gpu_test(request, monkeypatch):
    """The reference runs are float32 on the CPU, so the engine runs there too, also on a machine
    with a GPU; tests marked `gpu` choose their own device."""
    if request.node.get_closest_marker("gpu") is None:
        import nanoinfer.entrypoints.llm as llm_module
        monkeypatch.setattr(llm_module, "Config", functools.partial(llm_module.Config, device="cpu"))
        yield
        return
    yield
    # An engine a GPU test dropped leaves its memory in this process's CUDA cache, where the
    # tensor-parallel workers of a later test (other processes) would count it as taken.
    gc.unfreeze()   # the engine froze its objects (LLMEngine.__init__)
    gc.collect()
    torch.cuda.empty_cache()


@pytest.fixture(scope="session")
def model_dirs(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("models")
    return {family: save_model(family, str(root / family)) for family in ("llama", "qwen2", "qwen3")}


@pytest.fixture(scope="session")
def llama_dir(model_dirs) -> str:
    return model_dirs["llama"]


def copy_model(src: str, dst, **generation_config) -> str:
    """A copy of a model folder, with generation_config.json fields replaced."""
    shutil.copytree(src, dst)
    path = os.path.join(dst, "generation_config.json")
    with open(path) as f:
        cfg = json.load(f)
    cfg.update(generation_config)
    with open(path, "w") as f:
        json.dump(cfg, f)
    return str(dst)


_hf_models = {}


def hf_greedy(model_dir: str, prompt_token_ids: list[int], max_new_tokens: int, **generation) -> list[int]:
    """transformers' own greedy generate, EOS ignored: the reference output."""
    if model_dir not in _hf_models:
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
        model.generation_config.eos_token_id = None   # some versions fall back to it: never stop early
        _hf_models[model_dir] = model
    config = GenerationConfig(do_sample=False, max_new_tokens=max_new_tokens, eos_token_id=None, pad_token_id=0,
                              **generation)
    with torch.no_grad():
        out = _hf_models[model_dir].generate(torch.tensor([prompt_token_ids]), generation_config=config)
    output = out[0, len(prompt_token_ids):].tolist()
    assert len(output) == max_new_tokens, "the reference stopped early"
    return output


def hf_logits(model_dir: str, token_ids: list[int]) -> torch.Tensor:
    hf_greedy(model_dir, [0], 1)   # load and cache the model
    with torch.no_grad():
        return _hf_models[model_dir](torch.tensor([token_ids])).logits[0]


def random_prompts(lengths: list[int], seed: int = 0, prefix: list[int] = ()) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [list(prefix) + torch.randint(3, VOCAB_SIZE, (n,), generator=g).tolist() for n in lengths]


def write_medusa_head(path: str, hidden_size: int, vocab_size: int, num_heads: int, num_layers: int = 1,
                      bias: bool = True, seed: int = 0) -> str:
    """A Medusa head folder with random weights (spec_decode/medusa.py documents the format)."""
    from safetensors.torch import save_file
    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for i in range(num_heads):
        for j in range(num_layers):
            tensors[f"blocks.{i}.layers.{j}.weight"] = torch.randn(hidden_size, hidden_size, generator=g) * 0.1
            if bias:
                tensors[f"blocks.{i}.layers.{j}.bias"] = torch.randn(hidden_size, generator=g) * 0.1
        tensors[f"lm_heads.{i}.weight"] = torch.randn(vocab_size, hidden_size, generator=g)
    os.makedirs(path, exist_ok=True)
    save_file(tensors, os.path.join(path, "model.safetensors"))
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump({"architectures": ["MedusaModel"], "hidden_size": hidden_size, "vocab_size": vocab_size,
                   "medusa_num_heads": num_heads, "medusa_num_layers": num_layers, "medusa_fc_bias": bias}, f)
    return path


def write_eagle_head(path: str, target_dir: str, fc_bias: bool = False, seed: int = 0) -> str:
    """An EAGLE head folder with random weights for the model in `target_dir` (spec_decode/eagle.py
    documents the format): a one-layer Llama config like the target's, and its tensors."""
    from safetensors.torch import save_file
    from transformers import AutoConfig
    config = AutoConfig.from_pretrained(target_dir)
    config.num_hidden_layers, config.bias = 1, fc_bias
    if getattr(config, "layer_types", None):
        config.layer_types = config.layer_types[:1]
    hidden, inter = config.hidden_size, config.intermediate_size
    head_dim = getattr(config, "head_dim", None) or hidden // config.num_attention_heads
    q, kv = config.num_attention_heads * head_dim, config.num_key_value_heads * head_dim
    g = torch.Generator().manual_seed(seed)
    shapes = {"fc.weight": (hidden, 2 * hidden), "layers.0.self_attn.q_proj.weight": (q, hidden),
              "layers.0.self_attn.k_proj.weight": (kv, hidden), "layers.0.self_attn.v_proj.weight": (kv, hidden),
              "layers.0.self_attn.o_proj.weight": (hidden, q), "layers.0.mlp.gate_proj.weight": (inter, hidden),
              "layers.0.mlp.up_proj.weight": (inter, hidden), "layers.0.mlp.down_proj.weight": (hidden, inter)}
    tensors = {name: torch.randn(shape, generator=g) * 0.2 for name, shape in shapes.items()}
    tensors["layers.0.post_attention_layernorm.weight"] = torch.ones(hidden)
    if config.model_type == "qwen3":   # per-head q/k norms
        for name in ("q_norm", "k_norm"):
            tensors[f"layers.0.self_attn.{name}.weight"] = torch.ones(head_dim)
    tensors["embed_tokens.weight"] = torch.zeros(config.vocab_size, hidden)   # ignored: the target's is used
    if fc_bias:
        tensors["fc.bias"] = torch.randn(hidden, generator=g) * 0.1
    os.makedirs(path, exist_ok=True)
    config.save_pretrained(path)
    save_file(tensors, os.path.join(path, "model.safetensors"))
    return path
