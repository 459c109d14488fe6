"""Incremental detokenization and stop strings.

Decoding one token at a time is wrong: a character's UTF-8 bytes may span several byte-level
tokens, and some tokenizers change a token's text depending on its neighbours (leading
spaces). So each step decodes a short window of recent tokens twice, with and without the new
ones, and emits the difference. While the window ends in an incomplete character (decoded as
U+FFFD) nothing is emitted and the window grows until the character is complete. Special tokens
that add no text (skipped) are dropped from the window.

Stop strings are searched only in the tail that the new text could have completed; the output
is cut just before the stop string (just after it with `include_stop_str_in_output`).
"""
from transformers import PreTrainedTokenizerBase, PreTrainedTokenizerFast

from nanoinfer.sampling_params import SamplingParams


class IncrementalDetokenizer:

    def __init__(self, tokenizer: PreTrainedTokenizerBase, prompt_token_ids: list[int],
                 params: SamplingParams):
        self.tokenizer = tokenizer
        self.params = params
        # a few prompt tokens of context, so the first output token decodes as it would in the text
        self.token_ids = list(prompt_token_ids[-5:])
        self.prefix_offset, self.read_offset = 0, len(self.token_ids)
        self.num_output_tokens = 0
        self.output_text = ""
        self.max_stop_len = max((len(s) for s in params.stop), default=0)
        self.skipped = set(tokenizer.all_special_ids) if params.skip_special_tokens else set()
        # A fast tokenizer's own (Rust) decode: all that transformers' decode does (but for the
        # clean-up of spaces, off here) unless the class changes it; its wrapper costs twice the
        # decode itself, and this runs twice per token of a stream.
        kind = type(tokenizer)
        plain = (getattr(kind, "decode", None) is PreTrainedTokenizerBase.decode
                 and getattr(kind, "_decode", None) is PreTrainedTokenizerFast._decode)
        self.backend = tokenizer.backend_tokenizer if plain else None

    def _decode(self, token_ids: list[int]) -> str:
        skip = self.params.skip_special_tokens
        if self.backend is not None:
            return self.backend.decode(token_ids, skip_special_tokens=skip)
        return self.tokenizer.decode(token_ids, skip_special_tokens=skip,
                                     clean_up_tokenization_spaces=False)

    def update(self, new_token_ids: list[int], finished: bool) -> str | None:
        """Add the text of the new tokens to `output_text`; return the stop string if one now
        appears (the text is then cut at it). A finished request's last, incomplete character is
        flushed rather than held back.

        `new_token_ids`: a step's output tokens (maybe none); `finished`: the request ends with
        them. `output_text` is always a prefix of the decoded output tokens: it never ends in a
        character still incomplete (U+FFFD) before the request finishes, it holds all the text
        once the tokens so far decode to whole characters, and once finished it is
        tokenizer.decode of all of them (`_decode`: special tokens skipped as the params say;
        ids the tokenizer does not know add nothing). Each update decodes only a short window of
        recent tokens (`token_ids` from `prefix_offset` on, with a few prompt tokens as context);
        skipped special tokens that add no text leave it, so that a run of them keeps it short.
        Stop strings count once more than `params.min_tokens` output tokens are out, and only
        where this update's new text completes them (an occurrence that ended in earlier text is
        not found later); the first of `params.stop` found is returned, and the text is cut just
        before it (just after it with `include_stop_str_in_output`)."""
        self.token_ids += new_token_ids
        self.num_output_tokens += len(new_token_ids)
        prefix_text = self._decode(self.token_ids[self.prefix_offset:self.read_offset])
        new_text = self._decode(self.token_ids[self.prefix_offset:])
        # Special tokens that are skipped add no text: forget them, or the window grows with each
        # (EOS with ignore_eos).
        if new_text == prefix_text and self.skipped.issuperset(new_token_ids):
            del self.token_ids[self.read_offset:]
            return None
        if len(new_text) <= len(prefix_text) or (new_text.endswith("\ufffd") and not finished):
            return None
        delta = new_text[len(prefix_text):]
        self.prefix_offset, self.read_offset = self.read_offset, len(self.token_ids)
        self.output_text += delta
        # Stop strings do not count until min_tokens tokens are out.
        if not self.params.stop or self.num_output_tokens <= self.params.min_tokens:
            return None
        # Only where the new text could have completed a stop string.
        for stop in self.params.stop:
            start = max(len(self.output_text) - len(delta) - len(stop) + 1, 0)
            idx = self.output_text.find(stop, start)
            if idx != -1:
                end = idx + len(stop) if self.params.include_stop_str_in_output else idx
                self.output_text = self.output_text[:end]
                return stop
        return None

    def visible_text(self, finished: bool) -> str:
        """The text that may be returned now: while a stop string could still be completing at
        its end, its possible beginning (up to the longest stop string but one) is held back.

        A prefix of `output_text` that never shrinks from call to call. Before the request
        finishes it leaves out every end of the text that begins a stop string, and at most the
        longest stop string's length minus one characters; with `include_stop_str_in_output`
        (the stop string is shown anyway), and once finished, it is all of `output_text`."""
        keep_all = finished or self.params.include_stop_str_in_output
        hold = 0 if keep_all else max(self.max_stop_len - 1, 0)
        return self.output_text[:max(len(self.output_text) - hold, 0)]
