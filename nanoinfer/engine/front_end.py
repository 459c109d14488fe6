"""What the offline engine (`LLMEngine`) and the server's (`AsyncLLM`) share: the front end.

The front end is everything that happens away from the GPU, before and after the engine core:
the tokenizer, the `InputProcessor` (a prompt and its SamplingParams become a validated
`EngineCoreRequest` of token ids) and the `OutputProcessor` (each step's token ids become text,
stop strings and `RequestOutput`s). `LLMEngine` runs the core in its own process, a step at a
time; `AsyncLLM` runs it in another process and streams outputs to an event loop.
"""
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from nanoinfer.config import Config
from nanoinfer.engine.input_processor import InputProcessor
from nanoinfer.engine.output_processor import OutputProcessor


class FrontEnd:

    def __init__(self, config: Config):
        self.config = config
        self.tokenizer = load_tokenizer(config)
        self.input_processor = InputProcessor(config, self.tokenizer)
        self.output_processor = OutputProcessor(self.tokenizer)


def load_tokenizer(config: Config) -> PreTrainedTokenizerBase | None:
    """The model's tokenizer (None with skip_tokenizer_init)."""
    if config.skip_tokenizer_init:
        return None
    try:
        return AutoTokenizer.from_pretrained(config.model)
    except (OSError, ValueError) as e:
        raise ValueError(f"cannot load a tokenizer from {config.model!r}: {e}") from e
