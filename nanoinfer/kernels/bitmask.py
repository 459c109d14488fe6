"""The grammar's bitmask on the logits: every token whose bit is 0 gets -inf, in place.

Row r of the mask is 32 tokens to an int32 word: token t is allowed when bit t % 32 of word
t // 32 is set (structured_output/token_index.py). One program takes `BLOCK` tokens of one row,
reads their words and writes -inf where the bit is clear; allowed logits are not touched. On
the CPU the same in torch, which is also the kernel's test oracle.
"""
import torch
import triton
import triton.language as tl


@triton.jit
def apply_bitmask_kernel(logits_ptr, bitmask_ptr, vocab_size, logits_stride, bitmask_stride, BLOCK: tl.constexpr):
    row, block = tl.program_id(0), tl.program_id(1)
    offs = block * BLOCK + tl.arange(0, BLOCK)
    inside = offs < vocab_size
    words = tl.load(bitmask_ptr + row * bitmask_stride + offs // 32, mask=inside, other=-1)
    blocked = ((words >> (offs % 32)) & 1) == 0
    tl.store(logits_ptr + row * logits_stride + offs, float("-inf"), mask=inside & blocked)


def apply_token_bitmask_torch(logits: torch.Tensor, bitmask: torch.Tensor) -> None:
    vocab_size = logits.shape[1]
    shifts = torch.arange(32, dtype=torch.int32, device=logits.device)
    bits = (bitmask.unsqueeze(-1) >> shifts) & 1   # [rows, words, 32]
    logits.masked_fill_(bits.flatten(1)[:, :vocab_size] == 0, float("-inf"))


def apply_token_bitmask_triton(logits: torch.Tensor, bitmask: torch.Tensor, block: int = 4096) -> None:
    grid = (logits.shape[0], triton.cdiv(logits.shape[1], block))
    apply_bitmask_kernel[grid](logits, bitmask, logits.shape[1], logits.stride(0), bitmask.stride(0), BLOCK=block)


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor) -> None:
    """logits: [rows, vocab]; bitmask: int32 [rows, ceil(vocab / 32)]."""
    (apply_token_bitmask_triton if logits.is_cuda else apply_token_bitmask_torch)(logits, bitmask)
