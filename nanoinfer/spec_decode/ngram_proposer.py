"""n-gram drafts (prompt lookup): guess that the text repeats itself.

Take the sequence's last n tokens, for n from `prompt_lookup_max` down to `prompt_lookup_min`,
and find the earliest earlier place where the same n tokens occur; the k tokens that followed
them there are the draft. Rewriting, summarising and code editing copy long runs from the prompt,
and there a draft is often right for several tokens at once. It costs no model at all: one pass
over the sequence on the host, in the engine's process, which holds every sequence's tokens.

The search: every earlier position holding the last token is a candidate end of a match; the
candidates are extended backwards one token at a time (a numpy mask each time), and the longest
match wins, the earliest among equals. A match may overlap the suffix itself (periodic text).
"""
import weakref

import numpy as np

from nanoinfer.core.sequence import Sequence


class NgramProposer:

    def __init__(self, k: int, min_n: int, max_n: int, max_model_len: int):
        self.k, self.min_n, self.max_n, self.max_model_len = k, min_n, max_n, max_model_len
        # each sequence's tokens as an int32 array, appended to as they come (a list converted
        # every step would cost more than the search); gone with the sequence
        self.arrays: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()

    def propose(self, seq: Sequence) -> list[int]:
        array, n = self.arrays.get(seq, (None, 0))
        if array is None or len(array) < seq.num_tokens:
            grown = np.empty(max(seq.num_tokens, min(2 * seq.num_tokens, self.max_model_len)), np.int32)
            grown[:n] = array[:n] if array is not None else []
            array = grown
        array[n:seq.num_tokens] = seq.token_ids[n:]
        self.arrays[seq] = array, seq.num_tokens
        k = min(self.k, self.max_model_len - seq.num_tokens - 1)
        return self.find(array[:seq.num_tokens], k) if k > 0 else []

    def find(self, tokens: np.ndarray, k: int) -> list[int]:
        last = len(tokens) - 1
        ends = np.flatnonzero(tokens[:last] == tokens[last])   # earlier places of the last token
        length = np.ones(len(ends), np.int64)                  # how far each match reaches back
        for m in range(1, self.max_n):
            grow = (length == m) & (ends >= m)
            grow[grow] = tokens[ends[grow] - m] == tokens[last - m]
            length += grow
        if not len(ends) or length.max() < self.min_n:
            return []
        end = ends[np.argmax(length == length.max())]   # the earliest of the longest
        return tokens[end + 1:end + 1 + k].tolist()
