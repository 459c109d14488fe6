"""Throughput benchmark: nano-vllm's workload, against the hardware's limit.

Workload (DESIGN.md): random.seed(0); 256 prompts of random token ids in [0, 10000] with
lengths U[100, 1024]; each with max_tokens U[100, 1024], temperature 0.6, ignore_eos.
Output tok/s = sum(max_tokens) / wall time (133,966 output tokens). The default model has
Qwen3-0.6B's shape with random weights (throughput does not depend on their values);
--model runs a real checkpoint.

Next to the result it prints the roofline for the same workload: the bytes that must move
(every weight once per decode step, every cached K/V entry once per token that attends to it)
over the measured HBM bandwidth, and the FLOPs over the measured matmul peak.

On a machine without CUDA it scales itself down (a few short prompts) so it ends in about a
minute, and says so; the roofline is only printed on a GPU.
"""
import argparse
import json
import os
import random
import tempfile
import time

import torch

from nanoinfer import LLM, SamplingParams

QWEN3_0_6B = dict(architectures=["Qwen3ForCausalLM"], model_type="qwen3", hidden_size=1024,
                  intermediate_size=3072, num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8,
                  head_dim=128, vocab_size=151936, max_position_embeddings=40960, rms_norm_eps=1e-6,
                  rope_theta=1000000.0, tie_word_embeddings=True, hidden_act="silu", torch_dtype="bfloat16",
                  bos_token_id=151643, eos_token_id=151645)


def workload(num_seqs: int, max_input_len: int, max_output_len: int):
    random.seed(0)
    min_in, min_out = min(100, max_input_len), min(100, max_output_len)
    prompts = [[random.randint(0, 10000) for _ in range(random.randint(min_in, max_input_len))]
               for _ in range(num_seqs)]
    params = [SamplingParams(temperature=0.6, ignore_eos=True, max_tokens=random.randint(min_out, max_output_len))
              for _ in range(num_seqs)]
    return prompts, params


def roofline(cfg, prompt_lens: list[int], output_lens: list[int], dtype_bytes: int) -> tuple[float, float]:
    """(bytes that must move, FLOPs that must run) for the workload, all sequences decoding together."""
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    q, kv = cfg.num_attention_heads * head_dim, cfg.num_key_value_heads * head_dim
    per_layer = cfg.hidden_size * (q + 2 * kv) + q * cfg.hidden_size + 3 * cfg.hidden_size * cfg.intermediate_size
    matmul_params = cfg.num_hidden_layers * per_layer + cfg.vocab_size * cfg.hidden_size   # + LM head
    kv_bytes_per_token = 2 * cfg.num_hidden_layers * kv * dtype_bytes
    # each decode step reads all weights once; output token j of a sequence attends to prompt + j keys
    decode_steps = max(output_lens)
    kv_reads = sum(p * o + o * (o - 1) // 2 for p, o in zip(prompt_lens, output_lens))
    bytes_moved = decode_steps * matmul_params * dtype_bytes + kv_reads * kv_bytes_per_token
    prefill_keys = sum(p * (p + 1) // 2 for p in prompt_lens)
    attn_flops = 4 * cfg.num_attention_heads * head_dim * cfg.num_hidden_layers * (prefill_keys + kv_reads)
    flops = (2 * cfg.num_hidden_layers * per_layer * (sum(prompt_lens) + sum(output_lens))
             + 2 * cfg.vocab_size * cfg.hidden_size * sum(output_lens)   # LM head, once per sampled token
             + attn_flops)
    return bytes_moved, flops


def measure_gpu_limits() -> tuple[float, float]:
    """(copy bandwidth in bytes/s, counting read + write; bf16 matmul FLOP/s), median of runs."""
    import triton.testing
    src = torch.empty(2 * 2**30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    ms = triton.testing.do_bench(lambda: dst.copy_(src), return_mode="median")
    bandwidth = 2 * src.numel() / (ms * 1e-3)
    del src, dst
    a = torch.randn(8192, 8192, dtype=torch.bfloat16, device="cuda")
    b = torch.randn(8192, 8192, dtype=torch.bfloat16, device="cuda")
    ms = triton.testing.do_bench(lambda: a @ b, return_mode="median")
    return bandwidth, 2 * 8192**3 / (ms * 1e-3)


def main():
    parser = argparse.ArgumentParser(description="nanoinfer throughput benchmark")
    parser.add_argument("--model", default=None, help="HF model folder (default: Qwen3-0.6B shape, random weights)")
    parser.add_argument("--num-seqs", type=int, default=256)
    parser.add_argument("--max-input-len", type=int, default=1024)
    parser.add_argument("--max-output-len", type=int, default=1024)
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--max-num-batched-tokens", type=int, default=16384)
    parser.add_argument("--enforce-eager", action="store_true")
    parser.add_argument("--tp", type=int, default=1, help="tensor_parallel_size")
    args = parser.parse_args()

    on_gpu = torch.cuda.is_available()
    if not on_gpu:
        print("No CUDA device: scaled down to 8 prompts of <= 256 tokens and <= 32 output tokens, "
              "so it ends in about a minute. CPU numbers say nothing about GPU throughput.")
        args.num_seqs, args.max_input_len, args.max_output_len = 8, 256, 32
    kwargs = dict(max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
                  enforce_eager=args.enforce_eager, tensor_parallel_size=args.tp,
                  max_model_len=args.max_input_len + args.max_output_len)
    model = args.model
    if model is None:
        model = tempfile.mkdtemp(prefix="nanoinfer-bench-")
        with open(os.path.join(model, "config.json"), "w") as f:
            json.dump(QWEN3_0_6B, f)
        kwargs.update(load_format="dummy", skip_tokenizer_init=True)
    llm = LLM(model, **kwargs)

    prompts, params = workload(args.num_seqs, args.max_input_len, args.max_output_len)
    llm.generate([[1, 2, 3]], SamplingParams(max_tokens=4), use_tqdm=False)   # warm-up
    if on_gpu:
        torch.cuda.synchronize()
    start = time.perf_counter()
    llm.generate(prompts, params, use_tqdm=False)
    if on_gpu:
        torch.cuda.synchronize()
    elapsed = time.perf_counter() - start
    output_tokens = sum(p.max_tokens for p in params)
    input_tokens = sum(len(p) for p in prompts)
    print(f"{args.num_seqs} seqs, {input_tokens} input + {output_tokens} output tokens in {elapsed:.2f} s: "
          f"{output_tokens / elapsed:,.0f} output tok/s, {(input_tokens + output_tokens) / elapsed:,.0f} total tok/s")
    if on_gpu:
        cfg = llm.llm_engine.config.hf_config
        dtype_bytes = llm.llm_engine.config.torch_dtype.itemsize
        bytes_moved, flops = roofline(cfg, [len(p) for p in prompts], [p.max_tokens for p in params], dtype_bytes)
        bandwidth, peak = measure_gpu_limits()
        bound = max(bytes_moved / bandwidth, flops / peak)
        print(f"roofline on {torch.cuda.get_device_name()}: {bytes_moved / 1e12:.2f} TB at {bandwidth / 1e12:.2f} TB/s "
              f"= {bytes_moved / bandwidth:.2f} s; {flops / 1e12:.0f} TFLOP at {peak / 1e12:.0f} TFLOP/s = "
              f"{flops / peak:.2f} s; bound {output_tokens / bound:,.0f} output tok/s; "
              f"achieved {bound / elapsed:.1%} of it")


if __name__ == "__main__":
    main()
