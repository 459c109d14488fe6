"""From logits to next tokens, one row per sequence, each with its own sampling parameters.

Order of operations (vLLM's):
1. Logprobs, when asked for, are the raw model's: log_softmax of the logits as they come (but
   after a grammar's mask, see 2).
2. Logits processing. A guided request's grammar bitmask comes first (structured_output/; so its
   logprobs see the constraint, as vLLM's do). Then each request's `logit_bias` is added, and
   tokens that may not be sampled yet get -inf (EOS and stop ids before min_tokens). Then the
   penalties, from each row's tokens so far: repetition (for tokens of the
   prompt or the output, a positive logit is divided by it, a negative one multiplied), frequency
   (minus the penalty times the token's count in the output) and presence (minus the penalty if
   the output has the token).
3. Rows with temperature 0 take the argmax. Others: temperature, then the top-k / top-p / min-p
   masks, then a random draw from what is left.

The draw uses the exponential race: argmax(p / E) with E ~ Exp(1) i.i.d. picks token i with
probability p_i. Taken in log space, argmax(logits / T - log E), it needs no softmax, sort or
cumulative sum. Every row brings its own random seed (a seeded request's is derived from its
seed and the token's index, so its output does not depend on which other requests share the
batch). On a GPU the draw is one fused Triton kernel (`kernels/sampling.py`), and the grammar's
mask another (`kernels/bitmask.py`); on the CPU they are the same in torch, here (the kernels'
test oracles), and Triton is never imported.

Nothing here waits for the GPU: masks and penalties come as device tensors.
"""
from dataclasses import dataclass

import torch
from torch import nn



@dataclass
class Penalties:
    rows: torch.Tensor         # int64 [p]: the rows that have a penalty
    # int64 [p, L]: each one's tokens so far (prompt, output), padded with vocab_size
    token_ids: torch.Tensor
    is_output: torch.Tensor    # bool [p, L]: which of them are output tokens
    presence: torch.Tensor     # float32 [p]
    frequency: torch.Tensor    # float32 [p]
    repetition: torch.Tensor   # float32 [p]


@dataclass
class SamplingMetadata:
    temperatures: torch.Tensor          # float32 [rows]; 0 = greedy
    top_ks: torch.Tensor | None         # int64 [rows]; 0 = off; None when no row uses it
    top_ps: torch.Tensor | None         # float32 [rows]; 1 = off
    min_ps: torch.Tensor | None         # float32 [rows]; 0 = off
    # int64 [rows]: each row's random draw depends on its seed alone
    seeds: torch.Tensor
    all_greedy: bool
    max_num_logprobs: int | None        # the most top-N logprobs any row asked for
    # (rows, token ids, values) added to the logits: logit_bias, and -inf for tokens blocked
    logit_bias: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
    penalties: Penalties | None = None
    # int32 [table rows, ceil(vocab / 32)]: allowed tokens ...
    grammar_masks: torch.Tensor | None = None
    grammar_rows: torch.Tensor | None = None    # int32 [rows]: ... each row's mask (0: all)


@dataclass
class SamplerOutput:
    # int64 [rows, 1]: each row's token; with drafts, after `accept_drafts`, [requests, k + 1]:
    # a request's emitted tokens in order, padded with -1
    sampled_token_ids: torch.Tensor
    # int64 [rows, 1 + N]: the sampled token, then the top N
    logprob_token_ids: torch.Tensor | None = None
    logprobs: torch.Tensor | None = None           # float32 [rows, 1 + N]
    sampled_token_ranks: torch.Tensor | None = None   # int64 [rows]: 1 = the most likely token


def apply_penalties(logits: torch.Tensor, pen: Penalties) -> None:
    """Repetition, frequency and presence penalties, in place, on the rows that have them.

    `logits` [rows, vocab]; row `pen.rows[j]` of it takes the penalties of `pen`'s row j, from
    its tokens `pen.token_ids[j]` (padding = vocab, which counts nothing, whatever its
    `is_output` flag). First repetition, on each distinct token of the prompt or the output: a
    positive logit is divided by `repetition[j]`, a negative one multiplied. Then, for each
    token of the output, `frequency[j]` times its count in the output and `presence[j]` once are
    subtracted. Rows not in `pen.rows` and tokens not in the row's tokens are left alone."""
    vocab = logits.shape[1]
    num_rows = pen.token_ids.shape[0]
    # the padding column counts nothing
    output_ids = torch.where(pen.is_output, pen.token_ids, vocab)
    counts = torch.zeros(num_rows, vocab + 1, device=logits.device).scatter_add_(
        1, output_ids, torch.ones_like(output_ids, dtype=torch.float32))[:, :vocab]
    seen = torch.zeros(num_rows, vocab + 1, dtype=torch.bool, device=logits.device).scatter_(
        1, pen.token_ids, True)[:, :vocab]
    x = logits[pen.rows].float()
    repetition = pen.repetition.unsqueeze(1)
    x = torch.where(seen, torch.where(x > 0, x / repetition, x * repetition), x)
    x -= pen.frequency.unsqueeze(1) * counts + pen.presence.unsqueeze(1) * (counts > 0)
    logits[pen.rows] = x.to(logits.dtype)


def apply_top_k_top_p_min_p(logits: torch.Tensor, top_ks: torch.Tensor | None,
                            top_ps: torch.Tensor | None, min_ps: torch.Tensor | None
                            ) -> torch.Tensor:
    """Set the logits that the masks drop to -inf. Ties at the top-k boundary are kept.

    `logits` [rows, vocab] (already divided by the temperature); each mask has one value per
    row, or is None when no row uses it. In order: top-k keeps the tokens at least as large as
    the k-th largest logit (k = 0, or k >= vocab, keeps all); top-p then keeps, of what is left
    and by its renormalised probabilities, the smallest set of most likely tokens whose mass
    reaches p (p = 1 keeps all; the most likely token always stays); min-p then drops the
    tokens less likely than min_p times the most likely one (0 keeps all). Returns the masked
    logits (kept logits unchanged), a new tensor or `logits` itself."""
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


def gather_logprobs(logprobs: torch.Tensor, token_ids: torch.Tensor, num_top: int
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Of each row of logprobs [rows, vocab], the tokens `token_ids` [rows, 1] and the top
    `num_top`: their ids and logprobs [rows, 1 + num_top], the token first, and its rank [rows]
    (1 = the most likely)."""
    top = logprobs.topk(num_top, dim=-1)
    chosen = logprobs.gather(1, token_ids)
    return torch.cat([token_ids, top.indices], 1), torch.cat([chosen, top.values], 1), \
        (logprobs >= chosen).sum(dim=-1)


def score_prompt_tokens(compute_logits, hidden_states: torch.Tensor, index: torch.Tensor,
                        targets: torch.Tensor, num_top: int, chunk: int = 256
                        ) -> list[torch.Tensor] | None:
    """`gather_logprobs` of the tokens `targets` from the logits of the hidden states at `index`,
    `chunk` rows at a time (a row of float32 logits over a large vocabulary is half a MB); None
    on the ranks that get no logits (tensor parallelism: every rank must take part)."""
    out = []
    for i in range(0, len(index), chunk):
        logits = compute_logits(hidden_states[index[i:i + chunk]])
        if logits is not None:
            logprobs = logits.float().log_softmax(-1)
            out.append(gather_logprobs(logprobs, targets[i:i + chunk, None], num_top))
    return [torch.cat(parts) for parts in zip(*out)] if out else None


def exponential_race(logits: torch.Tensor, temperatures: torch.Tensor,
                     seeds: torch.Tensor) -> torch.Tensor:
    """The draw in torch (the CPU's path, and the GPU kernel's reference); T = 0 rows take the
    argmax.

    `logits` [rows, vocab] (-inf for masked tokens), `temperatures` float32 [rows], `seeds`
    int64 [rows] in [0, 2**63). Returns int64 [rows]: row i's token, drawn from
    softmax(logits[i] / temperatures[i]) with random numbers from a generator seeded with
    seeds[i] alone, so that a row draws the same token in any batch."""
    scaled = logits.float() / torch.where(temperatures > 0, temperatures, 1.0).unsqueeze(1)
    noise = torch.empty_like(scaled)
    for row, seed in enumerate(seeds.tolist()):
        noise[row].exponential_(generator=torch.Generator(logits.device).manual_seed(seed))
    sampled = scaled.sub_(noise.log_()).argmax(dim=-1)
    return torch.where(temperatures > 0, sampled, logits.argmax(dim=-1))


def apply_token_bitmask(logits: torch.Tensor, masks: torch.Tensor, rows: torch.Tensor) -> None:
    """logits: [n, vocab]; masks: int32 [table rows, ceil(vocab / 32)]; rows: int32 [n], each
    logits row's mask: token t is allowed if bit t % 32 of word t // 32 is set; the others get
    -inf, in place."""
    if logits.is_cuda:
        from nanoinfer.kernels.bitmask import apply_token_bitmask_triton
        return apply_token_bitmask_triton(logits, masks, rows)
    shifts = torch.arange(32, dtype=torch.int32, device=logits.device)
    bits = (masks[rows.long()].unsqueeze(-1) >> shifts) & 1   # [rows, words, 32]
    logits.masked_fill_(bits.flatten(1)[:, :logits.shape[1]] == 0, float("-inf"))


class Sampler(nn.Module):

    def forward(self, logits: torch.Tensor, meta: SamplingMetadata) -> SamplerOutput:
        """Sample one token per row of `logits` ([rows, vocab], changed in place)."""
        if meta.grammar_masks is not None:   # (first, as vLLM: the logprobs see it too)
            apply_token_bitmask(logits, meta.grammar_masks, meta.grammar_rows)
        raw_logprobs = None if meta.max_num_logprobs is None else logits.float().log_softmax(dim=-1)
        if meta.logit_bias is not None:
            allowed = None if meta.grammar_masks is None else logits.clone()
            rows, token_ids, values = meta.logit_bias
            logits.index_put_((rows, token_ids), values.to(logits.dtype), accumulate=True)
            if allowed is not None:   # a grammar that allows only what min_tokens blocks (EOS) wins
                logits.copy_(torch.where(logits.isneginf().all(-1, keepdim=True), allowed, logits))
        if meta.penalties is not None:
            apply_penalties(logits, meta.penalties)
        token_ids = self.sample(logits, meta).unsqueeze(1)
        if raw_logprobs is None:
            return SamplerOutput(token_ids)
        # (the logprob token ids, the logprobs, the sampled tokens' ranks)
        return SamplerOutput(token_ids, *gather_logprobs(raw_logprobs, token_ids,
                                                         meta.max_num_logprobs))

    @staticmethod
    def sample(logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
        if meta.all_greedy:
            return logits.argmax(dim=-1)
        temps = meta.temperatures
        if meta.top_ks is not None or meta.top_ps is not None or meta.min_ps is not None:
            logits = apply_top_k_top_p_min_p(logits / torch.where(temps > 0, temps, 1.0)[:, None],
                                             meta.top_ks, meta.top_ps, meta.min_ps)
            temps = (temps > 0).float()   # already applied
        if not logits.is_cuda:
            return exponential_race(logits, temps, meta.seeds)
        from nanoinfer.kernels.sampling import gumbel_max_sample
        return gumbel_max_sample(logits, temps, meta.seeds)
