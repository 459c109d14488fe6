"""Part 3 of the prefix-caching study (docs/prefix_study.py): the engine's own counters.

The multi-turn and system-prompt streams, smaller than the study's (the CPU decodes every reply
token), go through `nanoinfer.LLM` one request at a time, as the study's replay takes them: a
tiny Llama with random weights (2 layers, hidden size 64, the streams' 32,000-token vocabulary;
only a config.json, written to a temporary directory, with `load_format="dummy"`), greedy, and a
KV cache of 128 blocks (2,048 tokens; `--quick`: 48 blocks, 768 tokens), less than these streams'
distinct tokens, so that blocks are evicted too. A chat turn resends the model's own replies, so
the stream is made while the engine serves it.

The prompt tokens the engine computed come from its counters (`EngineCore.stats()`: the prompt
tokens looked up in the prefix cache, less those found there), and the tokens each request found
cached from its `RequestOutput.num_cached_tokens`; with prefix caching on, and then off for the
same prompts and output lengths (where the engine must compute every prompt token). The study
replays the same requests (prompts and the model's outputs) through its `HashedBlocks` with the
same number of blocks, and must find the same.
"""
import json
import os
import random
import tempfile
import time
from dataclasses import dataclass

from nanoinfer import LLM, SamplingParams
from prefix_streams import Reply, Request, multi_turn, system_prompt

NUM_BLOCKS = 128
QUICK_NUM_BLOCKS = 48
TINY_LLAMA = dict(architectures=["LlamaForCausalLM"], model_type="llama", hidden_size=64,
                  intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, vocab_size=32000, max_position_embeddings=8192,
                  rms_norm_eps=1e-6, rope_theta=10000.0, tie_word_embeddings=False,
                  hidden_act="silu", torch_dtype="float32", bos_token_id=1, eos_token_id=2)
SIZES = {"multi-turn chat": (multi_turn, dict(conversations=6, turns=4, reply_len=(4, 24))),
         "system prompt": (system_prompt, dict(apps=2, requests=16, reply_len=(1, 8),
                                               examples=(2, 4)))}
QUICK_SIZES = {"multi-turn chat": dict(conversations=2, turns=2, reply_len=(2, 4)),
               "system prompt": dict(apps=2, requests=4, reply_len=(1, 2), examples=(0, 0))}


@dataclass
class EngineRun:
    stream: list[Request]   # the prompts, and the model's outputs
    num_blocks: int         # of the KV cache
    cached: list[int]       # per request, prompt tokens found in the prefix cache
    computed_on: int        # prompt tokens computed, prefix caching on
    computed_off: int       # and off
    seconds_on: float
    seconds_off: float


def greedy(n: int) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)


def engine_reply(llm: LLM, cached: list[int]) -> Reply:
    """Replies that the engine generates, one request at a time; notes what each found cached."""
    def reply(prompt: list[int], n: int) -> list[int]:
        out = llm.generate(prompt, greedy(n), use_tqdm=False)[0]
        cached.append(out.num_cached_tokens)
        return list(out.outputs[0].token_ids)
    return reply


def prompt_tokens_computed(llm: LLM) -> int:
    stats = llm.llm_engine.engine_core.stats()
    return stats.prefix_cache_queries - stats.prefix_cache_hits


def engine_run(on: LLM, off: LLM, seed: int, make, sizes: dict, num_blocks: int) -> EngineRun:
    """One stream made by `on` (caching on) as it serves it, then the same requests by `off`."""
    on.reset_prefix_cache()
    cached, start, before = [], time.perf_counter(), prompt_tokens_computed(on)
    stream = make(random.Random(seed), engine_reply(on, cached), **sizes)
    seconds_on = time.perf_counter() - start
    computed_on = prompt_tokens_computed(on) - before
    start, before = time.perf_counter(), prompt_tokens_computed(off)
    for req in stream:
        off.generate(req.prompt, greedy(len(req.output)), use_tqdm=False)
    return EngineRun(stream, num_blocks, cached, computed_on,
                     prompt_tokens_computed(off) - before, seconds_on,
                     time.perf_counter() - start)


def engine_runs(seed: int, quick: bool) -> dict[str, EngineRun]:
    num_blocks = QUICK_NUM_BLOCKS if quick else NUM_BLOCKS
    options = dict(load_format="dummy", skip_tokenizer_init=True, device="cpu",
                   num_kvcache_blocks=num_blocks, max_model_len=num_blocks * 16)
    with tempfile.TemporaryDirectory(prefix="nanoinfer-prefix-study-") as model:
        with open(os.path.join(model, "config.json"), "w") as f:
            json.dump(TINY_LLAMA, f)
        on = LLM(model, **options)
        off = LLM(model, enable_prefix_caching=False, **options)
        runs = {name: engine_run(on, off, seed, make, QUICK_SIZES[name] if quick else sizes,
                                 num_blocks)
                for name, (make, sizes) in SIZES.items()}
        on.shutdown()
        off.shutdown()
    return runs
