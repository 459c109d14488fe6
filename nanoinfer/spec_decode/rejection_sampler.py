"""Verifying drafts so that the output is exactly the target model's.

A sequence with drafts x_1..x_k is scored at k+1 positions in one forward: row j gives the
target distribution p_j of the token at draft position j, and row k+1 the one after the last
draft. The rule (Leviathan et al., 2023; vLLM's), walking j = 1..k:
- accept x_j with probability min(1, p_j(x_j) / q_j(x_j)), q_j being the draft's distribution;
- at the first rejection, emit a token drawn from norm(max(p_j - q_j, 0)) and stop;
- if all k are accepted, emit a bonus token drawn from p_{k+1}.
So a step emits 1 to k+1 tokens. Why the emitted token is distributed as p exactly:
    P(y) = min(p, q)(y) + (1 - sum_z min(p, q)(z)) * (p - min(p, q))(y) / sum_z (p - min(p, q))(z)
         = p(y),
because both sums are the same mass (1 - sum min(p, q)); position after position, each conditioned
on the accepted prefix, this gives the target's joint distribution.

Every proposer here drafts greedily, so q is a point mass on x: accept x with probability p(x),
and on rejection draw from p without x. The engine does exactly that by sampling every row from
p as it would without speculation (`Sampler`: the same penalties, temperature and masks, the same
seed per output index) and accepting while the sample equals the draft: the sample equals x with
probability p(x), and given that it does not, it is a draw from p without x. The first differing
sample is the recovered token, the last row's the bonus. Greedy rows are the T = 0 case (accept
while the argmax agrees), and a seeded request emits the same tokens with or without speculation.
(tests/test_spec_decode.py has the rule for drafts with probabilities, as the reference it checks.)
"""
import torch


def accept_drafts(sampled: torch.Tensor, draft_token_ids: torch.Tensor,
                  num_drafts: torch.Tensor) -> torch.Tensor:
    """Point-mass drafts. sampled: int64 [rows], each sequence's k_i + 1 rows back to back;
    draft_token_ids: int64 [seqs, k] (k = the most drafts, padded with -1); num_drafts: int64
    [seqs]. All on one device; `sampled` may be a strided view. Returns int64 [seqs, k + 1]: the
    emitted tokens, then -1.

    Sequence i's rows are its samples at its drafts' positions and one more: row j (j < k_i)
    holds the token sampled where draft j stands, row k_i the one after the last draft. It
    emits its samples while they equal its drafts, then the first that does not (the token
    that replaces the rejected draft) or, when all k_i drafts are accepted, the last row's (the
    bonus token): 1 to k_i + 1 tokens, the accepted drafts first."""
    k = draft_token_ids.shape[1]
    start = torch.cumsum(num_drafts + 1, 0) - num_drafts - 1   # each sequence's first row
    cols = torch.arange(k + 1, device=sampled.device)
    index = (start.unsqueeze(1) + cols).clamp(max=len(sampled) - 1)
    tokens = sampled[index]                                       # [seqs, k + 1]
    agree = (tokens[:, :k] == draft_token_ids) & (cols[:k] < num_drafts.unsqueeze(1))
    num_accepted = agree.long().cumprod(1).sum(1)
    return torch.where(cols <= num_accepted.unsqueeze(1), tokens, -1)

