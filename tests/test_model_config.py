"""Reading model configs and checkpoints in their several forms."""
from types import SimpleNamespace

import pytest
from transformers import AutoModelForCausalLM

from conftest import hf_greedy, make_tokenizer, random_prompts
from nanoinfer import LLM, SamplingParams
from nanoinfer.layers.rotary_embedding import rope_config

LLAMA3 = {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 64}


def test_rope_config_transformers_4_and_5_forms():
    v4 = SimpleNamespace(rope_theta=500000.0, rope_scaling={"rope_type": "llama3", **LLAMA3})
    v5 = SimpleNamespace(rope_parameters={"rope_theta": 500000.0, "rope_type": "llama3", **LLAMA3})
    assert rope_config(v4)[0] == rope_config(v5)[0] == 500000.0
    assert rope_config(v4)[1]["factor"] == rope_config(v5)[1]["factor"] == 8.0
    assert rope_config(SimpleNamespace(rope_theta=1e6, rope_scaling=None)) == (1e6, None)
    assert rope_config(SimpleNamespace(rope_parameters={"rope_theta": 1e4, "rope_type": "default"})) == (1e4, None)
    old_key = SimpleNamespace(rope_theta=1e4, rope_scaling={"type": "llama3", **LLAMA3})
    assert rope_config(old_key)[1] is not None
    with pytest.raises(ValueError, match="rope type 'yarn' is not supported"):
        rope_config(SimpleNamespace(rope_parameters={"rope_theta": 1e4, "rope_type": "yarn"}))


def test_sharded_checkpoint_with_index(llama_dir, tmp_path):
    model = AutoModelForCausalLM.from_pretrained(llama_dir)
    model.save_pretrained(tmp_path, max_shard_size="100KB")
    make_tokenizer().save_pretrained(tmp_path)
    assert (tmp_path / "model.safetensors.index.json").exists()
    prompt = random_prompts([13], seed=21)[0]
    out = LLM(str(tmp_path)).generate(prompt, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True),
                                      use_tqdm=False)[0]
    assert out.outputs[0].token_ids == hf_greedy(llama_dir, prompt, 8)
