"""From logits to next tokens, one row per sequence, each with its own sampling parameters.

Order of operations (vLLM's): logprobs are taken from the raw logits; then temperature, then the
top-k / top-p / min-p masks, then a draw from the remaining distribution. Rows with
temperature 0 take the argmax.

The draw uses the exponential race: argmax(p / E) with E ~ Exp(1) i.i.d. picks token i with
probability p_i. Taken in log space, argmax(logits / T - log E), it needs no softmax, sort or
cumulative sum, and a seeded request draws its E from its own generator, so its output does
not depend on which other requests share the batch.
"""
from dataclasses import dataclass

import torch
from torch import nn


@dataclass
class SamplingMetadata:
    temperatures: torch.Tensor          # float32 [rows]; 0 = greedy
    top_ks: torch.Tensor | None         # int64 [rows]; 0 = off; None when no row uses it
    top_ps: torch.Tensor | None         # float32 [rows]; 1 = off
    min_ps: torch.Tensor | None         # float32 [rows]; 0 = off
    generators: dict[int, torch.Generator]  # row -> private generator of a seeded request
    all_greedy: bool
    all_random: bool                    # no row is greedy
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


class Sampler(nn.Module):

    def forward(self, logits: torch.Tensor, meta: SamplingMetadata) -> SamplerOutput:
        need_argmax = not meta.all_random or meta.max_num_logprobs is not None
        out = SamplerOutput(logits.argmax(dim=-1) if need_argmax else None)
        if meta.max_num_logprobs is not None:
            logprobs = logits.float().log_softmax(dim=-1)
            top = logprobs.topk(meta.max_num_logprobs, dim=-1)
            out.logprob_token_ids = torch.cat([out.token_ids.unsqueeze(1), top.indices], dim=1)
            out.logprobs = torch.cat([logprobs.gather(1, out.token_ids.unsqueeze(1)), top.values], dim=1)
        if meta.all_greedy:
            return out
        temps = meta.temperatures.unsqueeze(1)   # float32: the division also upcasts bf16 logits
        scaled = apply_top_k_top_p_min_p(logits / torch.where(temps > 0, temps, 1.0), meta.top_ks, meta.top_ps,
                                         meta.min_ps)
        noise = torch.empty_like(scaled).exponential_()
        for row, generator in meta.generators.items():
            noise[row].exponential_(generator=generator)
        sampled = scaled.sub_(noise.log_()).argmax(dim=-1)
        out.token_ids = sampled if meta.all_random else torch.where(meta.temperatures > 0, sampled, out.token_ids)
        if out.logprobs is not None:   # the first column is the token actually chosen
            out.logprob_token_ids[:, 0] = out.token_ids
            out.logprobs[:, 0] = logprobs.gather(1, out.token_ids.unsqueeze(1)).squeeze(1)
        return out
