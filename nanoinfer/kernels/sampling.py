"""Sampling as one pass over the logits: temperature, random draw and argmax fused.

The exponential race (see `layers/sampler.py`) in log space is the Gumbel-max trick: with
u ~ U(0, 1), argmax(logits / T - log(-log u)) is a draw from softmax(logits / T). In torch that
is five passes over a float32 copy of the [rows, vocab] logits (scale, draw, log, subtract,
argmax); here each program reads its slice of one row once, draws its uniforms in registers
(Philox, keyed by the row's seed and counted by the token index, so a row's draw depends
on its seed alone) and keeps a running best. A row with T = 0 takes the plain argmax.

The vocabulary is split over several programs per row so that a small batch still fills the
GPU; each writes its best (value, index) and a last argmax over the splits picks the token.
"""
import torch
import triton
import triton.language as tl


@triton.jit(do_not_specialize=["num_splits"])   # (it varies with the batch)
def gumbel_max_kernel(logits_ptr, temperatures_ptr, seeds_ptr, best_ptr, best_idx_ptr, vocab_size,
                      row_stride, split_len, num_splits, BLOCK: tl.constexpr):
    row, split = tl.program_id(0), tl.program_id(1)
    temperature = tl.load(temperatures_ptr + row)
    seed = tl.load(seeds_ptr + row)
    inv_t = 1.0 / tl.where(temperature > 0, temperature, 1.0)
    best = tl.full([BLOCK], float("-inf"), tl.float32)
    best_idx = tl.zeros([BLOCK], tl.int32)
    start, logits_row = split * split_len, logits_ptr + row * row_stride
    for off in range(start, tl.minimum(start + split_len, vocab_size), BLOCK):
        offs = off + tl.arange(0, BLOCK)
        mask = offs < vocab_size
        x = tl.load(logits_row + offs, mask=mask, other=float("-inf")).to(tl.float32) * inv_t
        # one Philox call gives 32 random bits for each of 4 neighbouring tokens
        if temperature > 0:
            r0, r1, r2, r3 = tl.randint4x(seed, off // 4 + tl.arange(0, BLOCK // 4))
            bits = tl.reshape(tl.join(tl.join(r0, r1), tl.join(r2, r3)), [BLOCK])
            # uniform on [0, 1) in steps of 2^-24
            u = (bits >> 8).to(tl.float32) * (1.0 / (1 << 24))
            x -= tl.log(-tl.log(u))
        better = mask & (x > best)
        best = tl.where(better, x, best)
        best_idx = tl.where(better, offs, best_idx)
    value = tl.max(best, 0)
    index = tl.min(tl.where(best == value, best_idx, vocab_size), 0)   # ties: the lowest index
    tl.store(best_ptr + row * num_splits + split, value)
    tl.store(best_idx_ptr + row * num_splits + split, index)


def gumbel_max_sample(logits: torch.Tensor, temperatures: torch.Tensor, seeds: torch.Tensor,
                      block: int = 2048) -> torch.Tensor:
    """logits [rows, vocab] (any float dtype), temperatures float32 [rows] (0 = greedy), seeds
    int64 [rows] -> sampled token ids int64 [rows]."""
    rows, vocab = logits.shape
    num_sms = (torch.cuda.get_device_properties(logits.device).multi_processor_count
               if logits.is_cuda else 8)
    num_splits = max(1, min(triton.cdiv(vocab, 8 * block), triton.cdiv(4 * num_sms, rows)))
    split_len, grid = triton.cdiv(triton.cdiv(vocab, num_splits), block) * block, (rows, num_splits)
    best = torch.empty(rows, num_splits, dtype=torch.float32, device=logits.device)
    best_idx = torch.empty(rows, num_splits, dtype=torch.int32, device=logits.device)
    gumbel_max_kernel[grid](logits, temperatures, seeds, best, best_idx, vocab, logits.stride(0),
                            split_len, num_splits, BLOCK=block, num_warps=8)
    return best_idx.gather(1, best.argmax(1, keepdim=True)).squeeze(1).long()
