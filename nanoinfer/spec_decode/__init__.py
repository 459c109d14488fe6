"""Speculative decoding: propose several tokens cheaply, verify them in one target forward.

Decode is bound by memory bandwidth: a step reads every weight to score one token per sequence,
and scoring k + 1 tokens of a sequence costs about the same. So a proposer guesses k tokens
(`ngram_proposer.py`: earlier text; `medusa.py` and `eagle.py`: small heads on the target's
hidden state), the scheduler counts them in the step's token budget and gives them KV slots, the
target scores all k + 1 positions in one forward (the prefill path over the paged cache), and
`rejection_sampler.py` keeps the longest prefix the target agrees with, plus one token of its own.
A step then emits 1 to k + 1 tokens, and the output is exactly what the target alone would give.

Rejected drafts leave keys and values in slots past the sequence's computed length; the next step
simply overwrites them. The block manager hashes only blocks of known tokens, so a block that
holds an unverified token is never entered in the prefix cache. While speculating, async
scheduling is off: the next step's positions, blocks and drafts depend on how many tokens this
step accepted, so the host must know them before it schedules.
"""


def make_drafter(config, target, tp_group):
    """The model runner's drafter: EAGLE's layer (on every rank), Medusa's heads (on the rank
    that samples), or None (n-gram drafts are the scheduler's). Both have `propose(step,
    hidden_states, last_rows, emitted)` -> the next step's drafts [requests, k]."""
    spec = config.speculative
    if spec is None or spec.method == "ngram":
        return None
    hf = config.hf_config
    k = spec.num_speculative_tokens
    if spec.method == "eagle":
        from nanoinfer.spec_decode.eagle import EagleProposer
        return EagleProposer(spec.model, k, target, hf, config.max_model_len, config.block_size,
                             tp_group)
    from nanoinfer.spec_decode.medusa import Medusa
    return Medusa(spec.model, k, hf.hidden_size, hf.vocab_size) if tp_group.is_first else None
