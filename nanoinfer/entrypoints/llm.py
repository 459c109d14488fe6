"""The offline API: `LLM(model).generate(prompts, sampling_params)`, as in vLLM.

A thin loop over the engine's API: every request of a call is validated and queued (if one is
bad, none stays queued), then the engine steps until all of them have finished, and the outputs
come back in the order of the prompts. Requests that others added to the same engine (through
`llm.llm_engine.add_request`) run alongside; their outputs are not collected here.
"""
import dataclasses
import sys
import time
from itertools import count

from tqdm.auto import tqdm

from nanoinfer.config import Config
from nanoinfer.engine.input_processor import PromptType
from nanoinfer.engine.llm_engine import LLMEngine
from nanoinfer.exceptions import ValidationError
from nanoinfer.outputs import RequestOutput
from nanoinfer.sampling_params import RequestOutputKind, SamplingParams


class LLM:

    def __init__(self, model: str | None = None, **kwargs):
        if model is None:
            from nanoinfer.default_model import default_model_path
            model = default_model_path()
        self.llm_engine = LLMEngine(Config(model, **kwargs))
        self.request_counter = count()

    def shutdown(self) -> None:
        """Stop the worker processes (tensor parallelism) and free the model and its KV cache.
        Also done at interpreter exit; the LLM cannot be used afterwards."""
        self.llm_engine.shutdown()

    def get_tokenizer(self):
        return self.llm_engine.tokenizer

    def reset_prefix_cache(self) -> bool:
        """Empty the prefix cache; False (and nothing done) while requests are running."""
        return self.llm_engine.scheduler.block_manager.reset_prefix_cache()

    def generate(self, prompts: PromptType | list[PromptType],
                 sampling_params: SamplingParams | list[SamplingParams] | None = None,
                 use_tqdm: bool = True) -> list[RequestOutput]:
        # (each prompt and its params are checked by the engine's InputProcessor)
        if not isinstance(prompts, (list, tuple)) or (prompts and type(prompts[0]) is int):
            prompts = [prompts]
        # (None, alone or in a list: the defaults)
        if not isinstance(sampling_params, (list, tuple)):
            sampling_params = [sampling_params] * len(prompts)
        if (n := len(sampling_params)) != len(prompts):
            raise ValidationError(f"got {n} sampling params for {len(prompts)} prompts",
                                  parameter="sampling_params")
        request_ids = []
        try:
            for prompt, params in zip(prompts, sampling_params):
                request_ids.append(self.next_request_id())
                params = SamplingParams() if params is None else params
                if isinstance(params, SamplingParams):
                    params = dataclasses.replace(params, output_kind=RequestOutputKind.FINAL_ONLY)
                self.llm_engine.add_request(request_ids[-1], prompt, params)
            return self.run_engine(request_ids, use_tqdm)
        # Nothing of this call stays queued: after an exception its requests are aborted (once
        # they have all finished, none is live, and this does nothing).
        finally:
            self.llm_engine.abort_request(request_ids)

    def next_request_id(self) -> str:
        """A new id, never one of a live request (which a caller may have chosen)."""
        while (rid := str(next(self.request_counter))) in self.llm_engine.output_processor.requests:
            pass
        return rid

    def run_engine(self, request_ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        engine = self.llm_engine
        outputs = {}
        wanted = set(request_ids)
        with tqdm(total=len(request_ids), desc="Processed prompts", dynamic_ncols=True,
                  disable=not use_tqdm or not sys.stderr.isatty()) as bar:
            while len(outputs) < len(request_ids):
                start = time.perf_counter()
                for out in engine.step():
                    if out.request_id in wanted and out.finished:
                        outputs[out.request_id] = out
                        bar.update(1)
                dt = time.perf_counter() - start
                core = engine.engine_core
                bar.set_postfix(prefill=f"{core.num_prefill_tokens / dt:.0f} tok/s",
                                decode=f"{core.num_decode_tokens / dt:.0f} tok/s", refresh=False)
        return [outputs[request_id] for request_id in request_ids]

    def chat(self, messages: list[dict] | list[list[dict]],
             sampling_params: SamplingParams | list[SamplingParams] | None = None,
             use_tqdm: bool = True, add_generation_prompt: bool = True) -> list[RequestOutput]:
        """Generate replies to one conversation or a list of them, through the chat template."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        processor = self.llm_engine.input_processor
        prompts = []
        for i, conversation in enumerate(conversations):
            try:
                prompts.append(processor.chat_prompt(conversation, add_generation_prompt))
            except ValueError as e:
                raise ValidationError(f"conversation {i}: {e}", parameter="messages") from None
        return self.generate(prompts, sampling_params, use_tqdm)
