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
import numpy as np


class NgramProposer:

    def __init__(self, k: int, min_n: int, max_n: int, max_model_len: int):
        self.k = k
        self.min_n = min_n
        self.max_n = max_n
        self.max_model_len = max_model_len
        # seq_id -> its tokens as an int32 array, appended to as they come (a list converted
        # every step would cost more than the search), and how many it holds
        self.arrays: dict[int, tuple[np.ndarray, int]] = {}

    def propose(self, seq_id: int, token_ids: list[int]) -> list[int]:
        """Drafts to follow a sequence's tokens (which only ever grow)."""
        array, n = self.arrays.get(seq_id, (None, 0))
        num_tokens = len(token_ids)
        if array is None or len(array) < num_tokens:
            grown = np.empty(max(num_tokens, min(2 * num_tokens, self.max_model_len)), np.int32)
            grown[:n] = array[:n] if array is not None else []
            array = grown
        array[n:num_tokens] = token_ids[n:]
        self.arrays[seq_id] = array, num_tokens
        k = min(self.k, self.max_model_len - num_tokens - 1)
        return self.find(array[:num_tokens], k) if k > 0 else []

    def remove(self, seq_id: int) -> None:
        """Forget a finished sequence's tokens."""
        self.arrays.pop(seq_id, None)

    def find(self, tokens: np.ndarray, k: int) -> list[int]:
        """The draft after `tokens` (int32 [num_tokens], a sequence's tokens so far): for n from
        `max_n` down to `min_n`, look for the last n tokens at an earlier place (one that ends
        before the last token; it may overlap the suffix); at the first n found, return the k
        tokens that follow its earliest place, fewer where the sequence ends first, as a list of
        ints. [] when no n in [min_n, max_n] is found."""
        last = len(tokens) - 1
        ends = np.flatnonzero(tokens[:last] == tokens[last])   # earlier places of the last token
        length = np.ones(len(ends), np.int64)                  # how far each match reaches back
        for m in range(1, min(self.max_n, last)):
            grow = (length == m) & (ends >= m)
            grow[grow] = tokens[ends[grow] - m] == tokens[last - m]
            length += grow
        if not len(ends) or length.max() < self.min_n:
            return []
        end = ends[np.argmax(length == length.max())]   # the earliest of the longest
        return tokens[end + 1:end + 1 + k].tolist()
