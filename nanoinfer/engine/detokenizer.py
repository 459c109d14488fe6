"""Incremental detokenization and stop strings.

Decoding one token at a time is wrong: a character's UTF-8 bytes may span several byte-level
tokens, and some tokenizers change a token's text depending on its neighbours (leading
spaces). So each step decodes a short window of recent tokens twice, with and without the new
ones, and emits the difference. While the window ends in an incomplete character (decoded as
U+FFFD) nothing is emitted and the window grows until the character is complete.

Stop strings are searched only in the tail that the new text could have completed; the output
is cut just before the stop string.
"""
from transformers import PreTrainedTokenizerBase

from nanoinfer.engine.sequence import Sequence


class IncrementalDetokenizer:

    def __init__(self, tokenizer: PreTrainedTokenizerBase, seq: Sequence):
        self.tokenizer = tokenizer
        self.seq = seq
        self.skip_special_tokens = seq.sampling_params.skip_special_tokens
        # window of context: a few prompt tokens, so the first output token decodes in context
        self.read_offset = seq.num_prompt_tokens
        self.prefix_offset = max(self.read_offset - 5, 0)
        self.stop = seq.sampling_params.stop
        self.max_stop_len = max((len(s) for s in self.stop), default=0)

    def _decode(self, token_ids: list[int]) -> str:
        return self.tokenizer.decode(token_ids, skip_special_tokens=self.skip_special_tokens,
                                     clean_up_tokenization_spaces=False)

    def update(self) -> str | None:
        """Add the text of the sequence's new tokens to seq.output_text; return the stop string
        if one now appears (the text is then cut before it). A finished sequence's last,
        incomplete character is flushed rather than held back."""
        seq = self.seq
        end = seq.num_tokens
        prefix_text = self._decode(seq.token_ids[self.prefix_offset:self.read_offset])
        new_text = self._decode(seq.token_ids[self.prefix_offset:end])
        if len(new_text) <= len(prefix_text) or (new_text.endswith("\ufffd") and not seq.is_finished):
            return None
        delta = new_text[len(prefix_text):]
        self.prefix_offset, self.read_offset = self.read_offset, end
        seq.output_text += delta
        if not self.stop or seq.num_output_tokens <= seq.sampling_params.min_tokens:
            return None
        search_from = max(len(seq.output_text) - len(delta) - self.max_stop_len + 1, 0)
        for stop in self.stop:
            idx = seq.output_text.find(stop, search_from)
            if idx != -1:
                seq.output_text = seq.output_text[:idx]
                return stop
        return None
