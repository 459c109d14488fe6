"""Structured output (guided decoding): every token a request samples keeps its text inside a
language, given as a regex, a JSON schema or a list of choices.

The pipeline, per request:
1. `add_request`: the constraint becomes a regex (json_schema.py; choices are an alternation of
   escaped literals) and its DFA is built at once (regex.py, dfa.py; under a second, and a
   pattern that would take longer is refused; cached by regex), so an unsupported feature, an
   unsatisfiable constraint or one too large is a ValueError there, never a failure later;
2. a background thread works out, against the tokenizer's vocabulary, the tokens of the DFA's
   start state (token_index.py); a second one then works out the other states' tokens ahead of
   need. Meanwhile the request waits in WAITING_FOR_FSM and the scheduler takes the requests
   behind it, so no compilation ever holds up a step. Token indexes are cached by regex;
3. each step, for each constrained request that samples, the bitmask of its DFA state (and with
   drafts, of the state after each draft: one row per sample row) is applied on the device, which
   sets every token outside it to -inf before sampling (kernels/bitmask.py). The masks (19 KB
   each at a 151,936-token vocabulary) are sent once: the device keeps a table of them, one row
   per (grammar, state) seen, row 0 allowing every token, and starts it again when it is full; a
   step's message (`GrammarOutput`) names rows of it and brings only the new ones;
4. each token the request emits advances its state (`Grammar.accept`); drafts are cut at the
   first one the grammar does not allow, which could never have been accepted.
The state lives with the request in the scheduler, so preemption keeps it. With async scheduling
the bitmask of step N + 1 needs step N's token: the engine then launches step N + 1's forward,
waits for step N's tokens, advances the states, and only then samples (`EngineCore.step`).
"""
import itertools
import re
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait

import numpy as np

from nanoinfer.core.messages import GrammarOutput
from nanoinfer.sampling_params import GuidedDecodingParams
from nanoinfer.structured_output.json_schema import json_schema_to_regex
from nanoinfer.structured_output.dfa import compile_regex
from nanoinfer.structured_output.token_index import TokenIndex, Vocabulary, vocabulary_bytes

MAX_CACHED_GRAMMARS = 32
MAX_MASK_ROWS = 2048   # the device's mask table: 39 MB at a 151,936-token vocabulary


class Grammar:
    """One request's constraint: its compiled token index, once ready, and its DFA state."""

    def __init__(self, compiled: Future):
        self.compiled = compiled
        self.index = None
        self.state = 0

    def ready(self) -> bool:
        """Has the compilation finished? (Raises its error if it failed.)"""
        if self.index is None and self.compiled.done():
            self.index = self.compiled.result()
            self.state = self.index.dfa.start
        return self.index is not None

    def accept(self, token_id: int) -> None:
        self.state = self.index.advance(self.state, token_id)

    def states(self, drafts: list[int]) -> list[int]:
        """The state now and after each draft."""
        return list(itertools.accumulate(drafts, self.index.advance, initial=self.state))

    def valid_drafts(self, drafts: list[int]) -> list[int]:
        """The drafts up to the first one the grammar does not allow."""
        after = self.states(drafts)[1:]
        return drafts[:after.index(0)] if 0 in after else drafts


def guided_regex(params: GuidedDecodingParams) -> str:
    """The constraint as a regex, checked: a ValueError names what is not supported."""
    if params.json is not None:
        regex = json_schema_to_regex(params.json)
    elif params.choice is not None:
        regex = "(" + "|".join(re.escape(c) for c in params.choice) + ")"
    else:
        regex = params.regex
    compile_regex(regex)   # (cached: the compile thread finds it made)
    return regex


class StructuredOutputManager:

    def __init__(self, tokenizer, vocab_size: int, eos_token_ids: list[int]):
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.eos_token_ids = eos_token_ids
        self.vocab: Vocabulary | None = None   # made on first use, in the thread
        self.indexes: dict[str, TokenIndex] = {}
        self.evicted: list[TokenIndex] = []   # left the cache (by the compile thread)
        # (grammar, state) -> its row in the device's mask table (row 0 allows every token)
        self.rows: dict[tuple[TokenIndex, int], int] = {}
        self.next_row = 1
        self.executor = ThreadPoolExecutor(1, thread_name_prefix="nanoinfer-grammar")
        self.warmer = ThreadPoolExecutor(1, thread_name_prefix="nanoinfer-grammar-warm")
        self.compiling: set[Future] = set()   # compilations submitted (some may be done)
        self.closed = False

    def compile(self, regex: str) -> Future:
        """Compile a checked regex (`guided_regex`) in the background."""
        index = self.indexes.get(regex)
        if index is not None:   # compiled before
            done = Future()
            done.set_result(index)
            return done
        # (the compilations still going, and this one: a finished one's index may be evicted)
        self.compiling = {f for f in self.compiling if not f.done()}
        future = self.executor.submit(self.token_index, regex)
        self.compiling.add(future)
        return future

    def token_index(self, regex: str) -> TokenIndex:
        if self.vocab is None:
            vocab_bytes = vocabulary_bytes(self.tokenizer, self.vocab_size)
            self.vocab = Vocabulary(vocab_bytes, self.eos_token_ids)
        index = self.indexes.get(regex)
        if index is None:
            index = TokenIndex(compile_regex(regex), self.vocab)
            index.bitmask(index.dfa.start)
            # (warming stops once the manager is closed, or the index has left the cache)
            self.warmer.submit(index.warm,
                               lambda: self.closed or self.indexes.get(regex) is not index)
            if len(self.indexes) >= MAX_CACHED_GRAMMARS:
                self.evicted.append(self.indexes.pop(next(iter(self.indexes))))   # the oldest
            self.indexes[regex] = index
        return index

    def grammar_bitmask(self, samples: list[tuple[int, Grammar, list[int]]]
                        ) -> GrammarOutput | None:
        """The mask rows of a step's constrained requests that sample: (seq_id, grammar,
        drafts) each, one row for its state now and one after each draft."""
        while self.evicted:   # grammars that left the cache: drop their rows, so they can be freed
            index = self.evicted.pop()
            self.rows = {key: row for key, row in self.rows.items() if key[0] is not index}
        # per request: (grammar, state) for its state now and after each draft
        request_keys = [[(grammar.index, state) for state in grammar.states(drafts)]
                        for _, grammar, drafts in samples]
        keys = [key for request in request_keys for key in request]
        if not keys:
            return None
        new_keys = {key: None for key in keys if key not in self.rows}   # (in order, once each)
        if self.next_row + len(new_keys) > MAX_MASK_ROWS + 1:   # the table is full: start it again
            self.reset()
            new_keys = dict.fromkeys(keys)
        for key in new_keys:
            self.rows[key] = self.next_row
            self.next_row += 1
        new_masks = None
        if new_keys:
            new_masks = np.stack([index.bitmask(state) for index, state in new_keys])
        return GrammarOutput(seq_ids=[seq_id for seq_id, _, _ in samples],
                             num_rows=[len(request) for request in request_keys],
                             mask_rows=[self.rows[key] for key in keys],
                             new_rows=[self.rows[key] for key in new_keys], new_masks=new_masks)

    def wait_for_compilation(self) -> None:
        """Nothing to run but grammars compiling: wait for one a little, rather than spin."""
        self.compiling = {f for f in self.compiling if not f.done()}
        if self.compiling:
            wait(self.compiling, timeout=0.05, return_when=FIRST_COMPLETED)

    def reset(self) -> None:
        """Forget which masks the device holds, and fill its table from row 1 again (when it is
        full; after an abort of everything, where the runner may have missed a step's)."""
        self.rows = {}
        self.next_row = 1

    def shutdown(self) -> None:
        self.closed = True
        for executor in (self.executor, self.warmer):
            executor.shutdown(wait=False, cancel_futures=True)
