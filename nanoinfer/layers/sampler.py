"""From logits to next tokens, one row per sequence, each with its own sampling parameters.

Order of operations (vLLM's): logprobs are taken from the raw logits; then temperature, then the
top-k / top-p / min-p masks, then a draw from the remaining distribution. Rows with
temperature 0 take the argmax.

The draw uses the exponential race: argmax(p / E) with E ~ Exp(1) i.i.d. picks token i with
probability p_i. Taken in log space, argmax(logits / T - log E), it needs no softmax, sort or
cumulative sum. Every row brings its own random seed (a seeded request's is derived from its
seed and the token's index, so its output does not depend on which other requests share the
batch). On a GPU the draw is one fused Triton kernel (`kernels/sampling.py`); on the CPU it is
the same race in torch, one generator per row.
"""
from dataclasses import dataclass

import torch
from torch import nn

from nanoinfer.kernels.sampling import gumbel_max_sample


@dataclass
class SamplingMetadata:
    temperatures: torch.Tensor          # float32 [rows]; 0 = greedy
    top_ks: torch.Tensor | None         # int64 [rows]; 0 = off; None when no row uses it
    top_ps: torch.Tensor | None         # float32 [rows]; 1 = off
    min_ps: torch.Tensor | None         # float32 [rows]; 0 = off
    seeds: torch.Tensor                 # int64 [rows]: each row's random draw depends on its seed alone
    all_greedy: bool
    max_num_logprobs: int | None        # the most top-N logprobs any row asked for


@dataclass
class SamplerOutput:
    token_ids: torch.Tensor                   # int64 [rows]
    logprobs: torch.Tensor | None = None      # [rows, 1 + N]: the sampled token's, then the top N
    logprob_token_ids: torch.Tensor | None = None


def apply_top_k_top_p_min_p(logits: torch.Tensor, top_ks: torch.Tensor | None, top_ps: torch.Tensor | None,
                            min_ps: torch.Tensor | None) -> torch.Tensor:
    """Set the logits that the masks drop to -inf. Ties at the top-k boundary are kept."""
    if top_ks is not None or top_ps is not None:
        sorted_logits, order = logits.sort(dim=-1)   # ascending
        vocab = logits.shape[-1]
        if top_ks is not None:
            k = torch.where(top_ks > 0, top_ks, vocab).clamp(max=vocab)
            kth = sorted_logits.gather(1, (vocab - k).unsqueeze(1))
            sorted_logits = sorted_logits.masked_fill(sorted_logits < kth, float("-inf"))
        if top_ps is not None:
            cum = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
            drop = cum <= (1 - top_ps).unsqueeze(1)
            drop[:, -1] = False   # the most likely token always stays
            sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        logits = torch.empty_like(logits).scatter_(1, order, sorted_logits)
    if min_ps is not None:
        probs = logits.softmax(dim=-1)
        threshold = min_ps.unsqueeze(1) * probs.max(dim=-1, keepdim=True).values
        logits = logits.masked_fill(probs < threshold, float("-inf"))
    return logits


def exponential_race(logits: torch.Tensor, temperatures: torch.Tensor, seeds: torch.Tensor) -> torch.Tensor:
    """The draw in torch (the CPU's path, and the GPU kernel's reference); T = 0 rows take the argmax."""
    scaled = logits.float() / torch.where(temperatures > 0, temperatures, 1.0).unsqueeze(1)
    noise = torch.empty_like(scaled)
    for row, seed in enumerate(seeds.tolist()):
        noise[row].exponential_(generator=torch.Generator(logits.device).manual_seed(seed))
    sampled = scaled.sub_(noise.log_()).argmax(dim=-1)
    return torch.where(temperatures > 0, sampled, logits.argmax(dim=-1))


class Sampler(nn.Module):

    def forward(self, logits: torch.Tensor, meta: SamplingMetadata) -> SamplerOutput:
        out = SamplerOutput(None)
        if meta.max_num_logprobs is not None:
            logprobs = logits.float().log_softmax(dim=-1)
            top = logprobs.topk(meta.max_num_logprobs, dim=-1)
        if meta.all_greedy:
            out.token_ids = logits.argmax(dim=-1)
        else:
            temps = meta.temperatures
            if meta.top_ks is not None or meta.top_ps is not None or meta.min_ps is not None:
                logits = apply_top_k_top_p_min_p(logits / torch.where(temps > 0, temps, 1.0).unsqueeze(1),
                                                 meta.top_ks, meta.top_ps, meta.min_ps)
                temps = (temps > 0).float()   # already applied
            draw = gumbel_max_sample if logits.is_cuda else exponential_race
            out.token_ids = draw(logits, temps, meta.seeds)
        if meta.max_num_logprobs is not None:   # the first column is the token actually chosen
            out.logprob_token_ids = torch.cat([out.token_ids.unsqueeze(1), top.indices], dim=1)
            out.logprobs = torch.cat([logprobs.gather(1, out.token_ids.unsqueeze(1)), top.values], dim=1)
        return out
