"""From a DFA over bytes to the tokens each state allows: the vocabulary walk and the bitmask.

The model picks tokens, not bytes, so each DFA state needs the set of tokens whose bytes, walked
from that state, end in a live state (one from which the text can still be completed; the
dead state 0 is where every wrong byte leads). The walk runs for all tokens at once, one byte
column at a time: `state = table[state, byte_class[tokens[:, j]]]`, dropping the tokens that
died or ended, so a state that allows few tokens costs little. EOS is allowed where the text
so far is a full match (an accepting state), and only there; an accepting state with no way on
allows EOS alone. (A vocabulary without every single byte as a token can leave a state that no
token leaves: there EOS is allowed, ending the request rather than breaking the constraint.)

The result is a bitmask, 32 tokens to an int32 word (bit t % 32 of word t // 32 is token t),
what the sampler receives. Once the grammar compiles, a background thread computes the bitmasks
of the states nearest the start (`warm`); a state reached before then is computed on the spot.

The vocabulary's bytes: byte-level BPE tokens (GPT-2, Llama 3, Qwen, SmolLM) spell bytes with
printable stand-in characters, which map back; SentencePiece tokens spell a space as '▁' and raw
bytes as `<0xAB>`. Special tokens have no bytes and are never allowed (EOS aside).
"""
import re
from collections import deque
from collections.abc import Callable

import numpy as np

from nanoinfer.structured_output.dfa import DFA
from nanoinfer.utils import cdiv


def byte_level_alphabet() -> dict[str, int]:
    """GPT-2's map from stand-in character to byte: printable bytes stand for themselves, the
    others for the characters from U+0100 on, in order."""
    # The bytes of "!" to "~", "¡" to "¬" and "®" to "ÿ".
    printable = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    others = [b for b in range(256) if b not in printable]
    return {chr(b): b for b in printable} | {chr(256 + i): b for i, b in enumerate(others)}


def vocabulary_bytes(tokenizer, vocab_size: int) -> list[bytes | None]:
    """Each token id's bytes (None: a special token, or an id the tokenizer does not have)."""
    decoder = tokenizer.backend_tokenizer.decoder
    byte_level = decoder is not None and b'"ByteLevel"' in decoder.__getstate__()
    to_bytes = {ord(c): b for c, b in byte_level_alphabet().items()}   # (str.translate: C speed)
    added = tokenizer.added_tokens_decoder
    out: list[bytes | None] = [None] * vocab_size
    for token, i in tokenizer.get_vocab().items():
        if i >= vocab_size:
            continue
        if i in added:
            out[i] = None if added[i].special else added[i].content.encode()
        elif token.startswith("<0x") and (m := re.fullmatch(r"<0x([0-9A-Fa-f]{2})>", token)):
            out[i] = bytes([int(m.group(1), 16)])
        elif byte_level:
            try:
                out[i] = token.translate(to_bytes).encode("latin-1")
            except UnicodeEncodeError:   # not spelled in the stand-in alphabet
                out[i] = token.encode()
        else:
            out[i] = token.replace("▁", " ").encode()
    return out


class Vocabulary:
    """A tokenizer's tokens as a byte matrix, made once per engine."""

    def __init__(self, token_bytes: list[bytes | None], eos_token_ids: list[int]):
        self.token_bytes = token_bytes
        self.eos_token_ids = eos_token_ids
        self.ids = ids = np.array([i for i, b in enumerate(token_bytes) if b], np.int64)
        self.lengths = lengths = np.array([len(token_bytes[i]) for i in ids], np.int64)
        self.matrix = np.zeros((len(ids), lengths.max(initial=1)), np.uint8)
        rows = np.repeat(np.arange(len(ids)), lengths)
        cols = np.arange(len(rows)) - np.repeat(np.cumsum(lengths) - lengths, lengths)
        self.matrix[rows, cols] = np.frombuffer(b"".join(token_bytes[i] for i in ids), np.uint8)
        self.size = len(token_bytes)
        self.num_words = cdiv(len(token_bytes), 32)


class TokenIndex:
    """One grammar's DFA against one vocabulary: per state, the bitmask of allowed tokens."""

    def __init__(self, dfa: DFA, vocab: Vocabulary):
        self.dfa = dfa
        self.vocab = vocab
        self.masks: dict[int, np.ndarray] = {}

    def next_states(self, state: int) -> np.ndarray:
        """int32 [vocab size]: the state each token leads to from `state` (0: it is not allowed).

        Token t's bytes (`vocab.token_bytes[t]`) walked from `state`: 0 if a byte leads to the
        dead state, or if the token has no bytes (None: a special token, an id the tokenizer does
        not have). `vocab.ids`, `lengths` and `matrix` hold the tokens that have bytes, as rows of
        a byte matrix (zero-padded), for walking them all at once."""
        vocab = self.vocab
        ends = np.zeros(vocab.size, np.int32)
        rows = np.arange(len(vocab.ids))
        states = np.full(len(rows), state, np.int32)
        for j in range(vocab.matrix.shape[1]):
            states = self.dfa.table[states, self.dfa.byte_class[vocab.matrix[rows, j]]]
            ended = vocab.lengths[rows] == j + 1
            ends[vocab.ids[rows[ended]]] = states[ended]
            keep = ~ended & (states != 0)
            rows, states = rows[keep], states[keep]
            if not len(rows):
                break
        return ends

    def allowed(self, state: int, ends: np.ndarray | None = None) -> np.ndarray:
        """Bool [vocab size]: the tokens allowed in `state`: those whose bytes end in a live
        state (`ends`: `next_states(state)`, if the caller has it already). EOS (each id of
        `vocab.eos_token_ids`) is allowed where the text so far is a full match (an accepting
        state), and also in the dead state 0 and in a state that no token leaves."""
        allowed = (self.next_states(state) if ends is None else ends) != 0
        # EOS is allowed in an accepting state, in state 0 (after an EOS that ignore_eos let pass)
        # and in a state no token leaves (in a vocabulary without all bytes).
        if state == 0 or self.dfa.accepting[state] or not allowed.any():
            allowed[self.vocab.eos_token_ids] = True
        return allowed

    def bitmask(self, state: int, ends: np.ndarray | None = None) -> np.ndarray:
        """int32 [words]: bit t % 32 of word t // 32 set if token t is allowed (`allowed(state,
        ends)`); the bits past the vocabulary are 0. `vocab.num_words` words. Made once per
        state and kept in `self.masks[state]`, which later calls return."""
        mask = self.masks.get(state)
        if mask is None:
            bits = np.zeros(self.vocab.num_words * 32, np.bool_)
            bits[:self.vocab.size] = self.allowed(state, ends)
            mask = self.masks[state] = np.packbits(bits, bitorder="little").view("<i4").astype("i4")
        return mask

    def warm(self, stop: Callable[[], bool], max_states: int = 256) -> None:
        """The bitmasks of the states nearest the start, up to `max_states` (in a background
        thread, so that requests find their states ready)."""
        todo, seen = deque([self.dfa.start]), {self.dfa.start}
        while todo and len(self.masks) < max_states and not stop():
            state = todo.popleft()
            ends = self.next_states(state)
            self.bitmask(state, ends)
            targets = [t for t in np.unique(ends[ends != 0]).tolist() if t not in seen]
            seen.update(targets)
            todo.extend(targets)

    def advance(self, state: int, token_id: int) -> int:
        """The state after `token_id` (EOS and tokens without bytes lead to the dead state 0)."""
        data = self.vocab.token_bytes[token_id] if token_id < self.vocab.size else None
        return self.dfa.walk(state, data) if data else 0
