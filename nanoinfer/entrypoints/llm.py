"""The offline API: `LLM(model).generate(prompts, sampling_params)`, as in vLLM.

All requests of a call are validated before any is queued; then the engine steps until they are
all finished, and the outputs come back in the order of the prompts.
"""
import time

from tqdm.auto import tqdm

from nanoinfer.config import Config
from nanoinfer.engine.llm_engine import LLMEngine, PromptType
from nanoinfer.outputs import RequestOutput
from nanoinfer.sampling_params import SamplingParams


class LLM:

    def __init__(self, model: str | None = None, **kwargs):
        if model is None:
            from nanoinfer.default_model import default_model_path
            model = default_model_path()
        self.llm_engine = LLMEngine(Config(model, **kwargs))

    def get_tokenizer(self):
        return self.llm_engine.tokenizer

    def reset_prefix_cache(self) -> bool:
        """Empty the prefix cache; False (and nothing done) while requests are running."""
        return self.llm_engine.scheduler.block_manager.reset_prefix_cache()

    def generate(self, prompts: PromptType | list[PromptType],
                 sampling_params: SamplingParams | list[SamplingParams] | None = None,
                 use_tqdm: bool = True) -> list[RequestOutput]:
        if isinstance(prompts, (str, dict)) or (isinstance(prompts, list) and prompts
                                                and isinstance(prompts[0], int)):
            prompts = [prompts]
        if sampling_params is None:
            sampling_params = SamplingParams()
        if isinstance(sampling_params, SamplingParams):
            sampling_params = [sampling_params] * len(prompts)
        if len(sampling_params) != len(prompts):
            raise ValueError(f"got {len(sampling_params)} sampling params for {len(prompts)} prompts")
        engine = self.llm_engine
        seqs = [engine.make_sequence(p, sp) for p, sp in zip(prompts, sampling_params)]
        for seq in seqs:
            engine.add_sequence(seq)
        outputs = {}
        bar = tqdm(total=len(seqs), desc="Processed prompts", dynamic_ncols=True, disable=not use_tqdm)
        try:
            while len(outputs) < len(seqs):
                t = time.perf_counter()
                finished = engine.step()
                dt = time.perf_counter() - t
                bar.set_postfix(prefill=f"{engine.num_prefill_tokens / dt:.0f} tok/s",
                                decode=f"{engine.num_decode_tokens / dt:.0f} tok/s", refresh=False)
                for out in finished:
                    outputs[out.request_id] = out
                bar.update(len(finished))
        finally:
            bar.close()
            for seq in seqs:   # on an exception, no request of this call stays queued
                if seq.request_id not in outputs:
                    engine.abort_request(seq.request_id)
        return [outputs[seq.request_id] for seq in seqs]

    def chat(self, messages: list[dict] | list[list[dict]],
             sampling_params: SamplingParams | list[SamplingParams] | None = None,
             use_tqdm: bool = True, add_generation_prompt: bool = True) -> list[RequestOutput]:
        """Generate replies to one conversation or a list of them, through the chat template."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        tokenizer = self.get_tokenizer()
        prompts = []
        for conversation in conversations:
            text = tokenizer.apply_chat_template(conversation, tokenize=False,
                                                 add_generation_prompt=add_generation_prompt)
            # the template already wrote any BOS: do not add special tokens again
            prompts.append({"prompt": text, "prompt_token_ids": tokenizer.encode(text, add_special_tokens=False)})
        return self.generate(prompts, sampling_params, use_tqdm)
