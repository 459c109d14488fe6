"""The engine loop: requests in, one scheduled step at a time, finished outputs out.

`step()` is the heart of the engine:
    schedule -> run the model on the flattened batch -> sample -> append tokens and check stops
    -> detokenize the new tokens (and check stop strings) -> return what finished.
With async scheduling (the default) the step's second half is done one step later: step N+1 is
scheduled and launched while step N still runs on the GPU, and only then does the host wait for
step N's tokens and process them. So the GPU never waits for the host's scheduling, input
building and detokenizing, as long as those take less time than a step's kernels.
Inputs are validated in `make_sequence` before anything is queued, so a bad request is
rejected with a clear error and never disturbs the requests already running.
"""
from collections import deque

from transformers import AutoTokenizer, PreTrainedTokenizerBase

from nanoinfer.config import Config
from nanoinfer.engine.block_manager import BlockManager
from nanoinfer.engine.detokenizer import IncrementalDetokenizer
from nanoinfer.engine.model_runner import AsyncModelRunnerOutput, ModelRunner
from nanoinfer.engine.scheduler import Scheduler, SchedulerOutput
from nanoinfer.engine.sequence import Sequence
from nanoinfer.outputs import CompletionOutput, RequestOutput
from nanoinfer.sampling_params import SamplingParams

PromptType = str | list[int] | dict


class LLMEngine:

    def __init__(self, config: Config):
        self.config = config
        self.tokenizer = None if config.skip_tokenizer_init else load_tokenizer(config.model)
        self.model_runner = ModelRunner(config)
        block_manager = BlockManager(self.model_runner.num_kvcache_blocks, config.block_size,
                                     config.enable_prefix_caching)
        self.scheduler = Scheduler(config, block_manager)
        self.detokenizers: dict[int, IncrementalDetokenizer] = {}
        self.in_flight: deque[tuple[SchedulerOutput, AsyncModelRunnerOutput]] = deque()   # launched steps
        self.num_prefill_tokens = self.num_decode_tokens = 0   # of the last step, for progress bars

    def make_sequence(self, prompt: PromptType, params: SamplingParams, request_id: str | None = None) -> Sequence:
        """Tokenize and validate one request; raises ValueError saying what is wrong with it."""
        if not isinstance(params, SamplingParams):
            raise ValueError(f"sampling params must be a SamplingParams, got {type(params).__name__}")
        text = None
        if self.tokenizer is None and (isinstance(prompt, str) or (isinstance(prompt, dict)
                                                                   and "prompt_token_ids" not in prompt)):
            raise ValueError("the engine has no tokenizer (skip_tokenizer_init): pass prompt token ids")
        if self.tokenizer is None and params.stop:
            raise ValueError("stop strings need a tokenizer; the engine was started with skip_tokenizer_init")
        if isinstance(prompt, str):
            text, token_ids = prompt, self.tokenizer.encode(prompt)
        elif isinstance(prompt, dict) and "prompt_token_ids" in prompt:
            text, token_ids = prompt.get("prompt"), prompt["prompt_token_ids"]
        elif isinstance(prompt, dict) and isinstance(prompt.get("prompt"), str):
            text, token_ids = prompt["prompt"], self.tokenizer.encode(prompt["prompt"])
        elif isinstance(prompt, list):
            token_ids = prompt
        else:
            raise ValueError("a prompt must be a str, a list of token ids, or a dict with 'prompt' or "
                             f"'prompt_token_ids', got {type(prompt).__name__}")
        if not isinstance(token_ids, list) or not all(type(t) is int for t in token_ids):
            raise ValueError("prompt token ids must be a list of integers")
        if not token_ids:
            raise ValueError("the prompt is empty: it must have at least one token")
        if len(token_ids) >= self.config.max_model_len:
            raise ValueError(f"the prompt has {len(token_ids)} tokens but max_model_len is "
                             f"{self.config.max_model_len} (prompt and output must fit)")
        vocab_size = self.config.hf_config.vocab_size
        bad = [t for t in token_ids if not 0 <= t < vocab_size]
        if bad:
            raise ValueError(f"prompt token id {bad[0]} is outside the vocabulary [0, {vocab_size})")
        return Sequence(token_ids, params, prompt=text, request_id=request_id)

    def add_sequence(self, seq: Sequence) -> None:
        if self.tokenizer is not None:
            self.detokenizers[seq.seq_id] = IncrementalDetokenizer(self.tokenizer, seq)
        self.scheduler.add(seq)

    def add_request(self, prompt: PromptType, params: SamplingParams, request_id: str | None = None) -> str:
        seq = self.make_sequence(prompt, params, request_id)
        self.add_sequence(seq)
        return seq.request_id

    def abort_request(self, request_id: str) -> RequestOutput | None:
        for seq in [*self.scheduler.running, *self.scheduler.waiting]:
            if seq.request_id == request_id:
                self.scheduler.finish(seq, "abort")
                self.detokenizers.pop(seq.seq_id, None)
                return make_output(seq)
        return None

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished() or bool(self.in_flight)

    def step(self) -> list[RequestOutput]:
        sched = self.scheduler.schedule()
        if sched.seqs:
            self.in_flight.append((sched, self.model_runner.execute_model(sched)))
        self.num_prefill_tokens = sum(n for n in sched.num_scheduled_tokens if n > 1)
        self.num_decode_tokens = sum(1 for n in sched.num_scheduled_tokens if n == 1)
        finished = []
        # async scheduling leaves the step just launched in flight and finishes the one before
        keep = 1 if self.config.async_scheduling and sched.seqs else 0
        while len(self.in_flight) > keep:
            finished += self.process_output(*self.in_flight.popleft())
        return finished

    def process_output(self, sched: SchedulerOutput, pending: AsyncModelRunnerOutput) -> list[RequestOutput]:
        runner_output = pending.get_output()
        finished = []
        for seq in self.scheduler.update_from_output(sched, runner_output.sampled_token_ids):
            if seq.logprobs is not None:
                seq.logprobs.append(runner_output.logprobs[seq.seq_id])
            detokenizer = self.detokenizers.get(seq.seq_id)
            stopped_by_token = seq.is_finished and seq.finish_reason == "stop"
            if detokenizer and not stopped_by_token:   # the EOS or stop token itself is not text
                stop_string = detokenizer.update()
                if stop_string is not None:
                    if seq.is_finished:
                        seq.finish_reason, seq.stop_reason = "stop", stop_string
                    else:
                        self.scheduler.finish(seq, "stop", stop_string)
            if seq.is_finished:
                self.detokenizers.pop(seq.seq_id, None)
                finished.append(make_output(seq))
        return finished


def make_output(seq: Sequence) -> RequestOutput:
    completion = CompletionOutput(0, seq.output_text, seq.output_token_ids, seq.finish_reason,
                                  seq.stop_reason, seq.logprobs)
    return RequestOutput(seq.request_id, seq.prompt, seq.prompt_token_ids, [completion],
                         seq.is_finished, seq.num_cached_tokens)


def load_tokenizer(model: str) -> PreTrainedTokenizerBase:
    try:
        return AutoTokenizer.from_pretrained(model)
    except (OSError, ValueError) as e:
        raise ValueError(f"cannot load a tokenizer from {model!r}: {e}") from e
