"""The grammar's bitmask on the logits: every token whose bit is 0 gets -inf, in place.

Logits row r takes its mask from row `rows[r]` of the device's mask table (explained in
structured_output/__init__.py); in a mask, token t is bit t % 32 of int32 word t // 32. One program
takes `BLOCK` tokens of one logits row, reads their words and writes -inf where the bit is clear;
allowed logits are untouched. On the CPU the same is done in torch (`apply_token_bitmask` in
layers/sampler.py, which calls this kernel on a GPU): that is also the kernel's test oracle.
"""
import torch
import triton
import triton.language as tl


@triton.jit
def apply_bitmask_kernel(logits_ptr, masks_ptr, rows_ptr, vocab_size, logits_stride, masks_stride,
                         BLOCK: tl.constexpr):
    row, block = tl.program_id(0), tl.program_id(1)
    mask_row = tl.load(rows_ptr + row).to(tl.int64)
    offs = block * BLOCK + tl.arange(0, BLOCK)
    inside = offs < vocab_size
    words = tl.load(masks_ptr + mask_row * masks_stride + offs // 32, mask=inside, other=-1)
    blocked = ((words >> (offs % 32)) & 1) == 0
    tl.store(logits_ptr + row * logits_stride + offs, float("-inf"), mask=inside & blocked)


def apply_token_bitmask_triton(logits: torch.Tensor, masks: torch.Tensor, rows: torch.Tensor,
                               block: int = 4096) -> None:
    """logits: [n, vocab] on a GPU; masks: int32 [table rows, ceil(vocab / 32)]; rows: int32 [n]."""
    grid = (logits.shape[0], triton.cdiv(logits.shape[1], block))
    apply_bitmask_kernel[grid](logits, masks, rows, logits.shape[1], logits.stride(0),
                               masks.stride(0), BLOCK=block)

