"""From the engine core's token updates to what the caller sees: text, logprobs, RequestOutputs.

This is the front end's half of a step (in a server it runs in the API process, away from the
GPU loop). For every sequence the step gave tokens, its `CompletionState` appends them, decodes
them incrementally (`detokenizer.py`), looks for stop strings and turns logprobs into `Logprob`
objects. Then each touched request makes its `RequestOutput` as its `output_kind` asks:
everything so far (CUMULATIVE), only what is new since the last one (DELTA), or nothing until
it finishes (FINAL_ONLY).

A request with n > 1 samples is one `RequestState` with n completions, each run by the engine as a
sequence of its own; it finishes when all of them have.
"""
import dataclasses
import time
from dataclasses import dataclass, field

from transformers import PreTrainedTokenizerBase

from nanoinfer.core.messages import EngineCoreOutput, EngineCoreRequest
from nanoinfer.engine.detokenizer import IncrementalDetokenizer
from nanoinfer.exceptions import ValidationError
from nanoinfer.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput
from nanoinfer.sampling_params import RequestOutputKind, SamplingParams


class CompletionState:
    """One sample of a request, as returned: its tokens, text and logprobs, and how much of them
    was already returned (for DELTA outputs)."""

    def __init__(self, index: int, params: SamplingParams, prompt_token_ids: list[int],
                 tokenizer: PreTrainedTokenizerBase | None):
        self.index = index
        self.params = params
        self.tokenizer = tokenizer
        self.detokenizer = None if tokenizer is None else \
            IncrementalDetokenizer(tokenizer, prompt_token_ids, params)
        self.token_ids: list[int] = []
        self.logprobs: list[dict[int, Logprob]] | None = None if params.logprobs is None else []
        self.cumulative_logprob = None if params.logprobs is None else 0.0
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None
        self.num_returned_tokens = self.num_returned_chars = 0

    def update(self, out: EngineCoreOutput) -> str | None:
        """Take one step's tokens; returns a stop string that now ends the sample, if any."""
        if len(out.new_token_ids) > 1 and self.params.stop and self.detokenizer is not None:
            return self.update_one_by_one(out)
        self.token_ids += out.new_token_ids
        self.finish_reason, self.stop_reason = out.finish_reason, out.stop_reason
        # A row is (token ids, logprobs, rank), the sampled token's first.
        for row in out.new_logprobs or ():
            self.cumulative_logprob += row[1][0]
            self.logprobs.append(logprob_entry(row, self.params.logprobs, self.tokenizer))
        if self.detokenizer is None:
            return None
        new_token_ids = out.new_token_ids
        if out.finish_reason == "stop" and not self.params.include_stop_str_in_output:
            # The EOS or stop token that ended it is not text.
            new_token_ids = new_token_ids[:-1]
        stop_string = self.detokenizer.update(new_token_ids, out.finish_reason is not None)
        if stop_string is not None:
            self.finish_reason, self.stop_reason = "stop", stop_string
        return stop_string

    def update_one_by_one(self, out: EngineCoreOutput) -> str | None:
        """Several tokens of one step (speculative decoding), taken as if each had come in a
        step of its own: a stop string ends the sample right after the token that completes
        it."""
        for i, token_id in enumerate(out.new_token_ids):
            last = i == len(out.new_token_ids) - 1
            stop_string = self.update(dataclasses.replace(
                out, new_token_ids=[token_id],
                new_logprobs=out.new_logprobs and out.new_logprobs[i:i + 1],
                finish_reason=out.finish_reason if last else None,
                stop_reason=out.stop_reason if last else None))
            if stop_string is not None:
                return stop_string
        return None

    def completion(self, delta: bool) -> CompletionOutput:
        finished = self.finish_reason is not None
        text = self.detokenizer.visible_text(finished) if self.detokenizer else ""
        token_ids, logprobs = self.token_ids, self.logprobs
        if delta:
            text, token_ids = text[self.num_returned_chars:], token_ids[self.num_returned_tokens:]
            logprobs = None if logprobs is None else logprobs[self.num_returned_tokens:]
            self.num_returned_chars += len(text)
            self.num_returned_tokens += len(token_ids)
        return CompletionOutput(index=self.index, text=text, token_ids=list(token_ids),
                                cumulative_logprob=self.cumulative_logprob,
                                logprobs=None if logprobs is None else list(logprobs),
                                finish_reason=self.finish_reason, stop_reason=self.stop_reason)


def logprob_entry(row: tuple[list[int], list[float], int], num_top: int, tokenizer
                  ) -> dict[int, Logprob]:
    """One token's logprobs (ids and logprobs: the token's own, then the top ones; its rank) as
    {token id: Logprob}, the token first and then the top `num_top`."""
    token_ids, logprobs, rank = row

    def decode(token_id: int) -> str | None:
        return None if tokenizer is None else tokenizer.decode([token_id])
    entry = {token_ids[0]: Logprob(logprobs[0], rank, decode(token_ids[0]))}
    for r, (t, lp) in enumerate(zip(token_ids[1:num_top + 1], logprobs[1:]), start=1):
        entry.setdefault(t, Logprob(lp, r, decode(t)))
    return entry


@dataclass(eq=False)
class RequestState:
    """A request as returned: its samples, its metrics, and what its outputs have sent."""
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    output_kind: RequestOutputKind
    completions: list[CompletionState]
    seq_ids: list[int]
    max_tokens: int
    metrics: RequestMetrics = field(
        default_factory=lambda: RequestMetrics(arrival_time=time.time()))
    num_cached_tokens: int = 0
    # the prompt's logprobs, which come with its first tokens (a DELTA output brings them once)
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    prompt_logprobs_sent: bool = False
    # The completions with news since the last output.
    updated: set[int] = field(default_factory=set)

    @property
    def finished(self) -> bool:
        return all(c.finish_reason is not None for c in self.completions)

    def make_output(self, finished: bool) -> RequestOutput | None:
        if self.output_kind == RequestOutputKind.FINAL_ONLY and not finished:
            return None
        delta = self.output_kind == RequestOutputKind.DELTA
        completions = [c.completion(delta) for c in self.completions
                       if not delta or c.index in self.updated]
        self.updated.clear()
        prompt_logprobs = None if delta and self.prompt_logprobs_sent else self.prompt_logprobs
        self.prompt_logprobs_sent |= prompt_logprobs is not None
        return RequestOutput(self.request_id, self.prompt, self.prompt_token_ids, completions,
                             finished, self.num_cached_tokens, self.metrics, prompt_logprobs)


@dataclass
class IterationStats:
    """What one step's outputs brought, counted as vLLM counts them for a server's metrics: the
    prompt tokens of the sequences whose first tokens came (a prompt counts once it has been
    computed), the tokens generated, and the requests that finished."""
    num_prompt_tokens: int = 0
    num_generation_tokens: int = 0
    finished: list[RequestState] = field(default_factory=list)

    def update(self, out: EngineCoreOutput, state: RequestState, completion: CompletionState):
        """Count a sequence's output, before its completion takes the tokens."""
        if out.new_token_ids and not completion.token_ids:
            self.num_prompt_tokens += len(state.prompt_token_ids)
        self.num_generation_tokens += len(out.new_token_ids)


class OutputProcessor:

    def __init__(self, tokenizer: PreTrainedTokenizerBase | None):
        self.tokenizer = tokenizer
        self.requests: dict[str, RequestState] = {}
        # seq_id -> its request, sample
        self.seqs: dict[int, tuple[RequestState, CompletionState]] = {}

    def add_request(self, prompt: str | None, request: EngineCoreRequest) -> None:
        """Follow a request the core is about to run; its id must not be a live request's."""
        if request.request_id in self.requests:
            raise ValidationError(f"request_id {request.request_id!r} is already in use by a live "
                                  "request", parameter="request_id")
        completions = [CompletionState(i, p, request.prompt_token_ids, self.tokenizer)
                       for i, p in enumerate(request.params)]
        state = RequestState(request.request_id, prompt, list(request.prompt_token_ids),
                             request.params[0].output_kind, completions, request.seq_ids,
                             max_tokens=request.max_tokens)
        self.requests[request.request_id] = state
        for seq_id, completion in zip(request.seq_ids, completions):
            self.seqs[seq_id] = state, completion

    def aborted_output(self, request_id: str) -> RequestOutput:
        """The request's last output, as if it were aborted now (its unfinished samples "abort")."""
        state = self.requests[request_id]
        for c in state.completions:
            if c.finish_reason is None:
                c.finish_reason = "abort"
                state.updated.add(c.index)
        return state.make_output(finished=True)

    def remove_request(self, request_id: str) -> list[int]:
        """Forget a request (aborted); returns its sequences' ids."""
        state = self.requests.pop(request_id)
        for seq_id in state.seq_ids:
            self.seqs.pop(seq_id, None)
        return state.seq_ids

    def process_outputs(self, core_outputs: list[EngineCoreOutput],
                        stats: IterationStats | None = None
                        ) -> tuple[list[RequestOutput], list[tuple[int, str]]]:
        """The step's RequestOutputs, and the sequences that a stop string ended (seq_id,
        string); with `stats`, the step counted there."""
        touched = {}
        stopped = []
        now = time.time()
        for out in core_outputs:
            if out.seq_id not in self.seqs:
                # Ended here (aborted, a stop string) while its step ran.
                continue
            state, completion = self.seqs[out.seq_id]
            if stats is not None:
                stats.update(out, state, completion)
            stop_string = completion.update(out)
            if stop_string is not None and out.finish_reason is None:
                stopped.append((out.seq_id, stop_string))
            if completion.finish_reason is not None:
                del self.seqs[out.seq_id]
            if out.num_draft_tokens:
                state.metrics.spec_decoding.observe(out.num_draft_tokens, out.num_accepted_tokens)
            if out.new_token_ids:
                state.metrics.first_token_time = state.metrics.first_token_time or now
                state.metrics.last_token_time = now
            # (counted for the first sample)
            if completion.index == 0:
                state.metrics.num_generation_tokens += len(out.new_token_ids)
                state.num_cached_tokens = out.num_cached_tokens
            # The prompt's logprobs come with any sample's first output.
            if out.prompt_logprobs is not None and state.prompt_logprobs is None:
                num_top = completion.params.prompt_logprobs
                state.prompt_logprobs = [None] + [logprob_entry(row, num_top, self.tokenizer)
                                                  for row in out.prompt_logprobs]
            metrics = state.metrics
            metrics.first_scheduled_time = metrics.first_scheduled_time or out.scheduled_time
            state.updated.add(completion.index)
            touched[state.request_id] = state
        outputs = []
        for state in touched.values():
            if finished := state.finished:
                state.metrics.finished_time = now
                del self.requests[state.request_id]
                if stats is not None:
                    stats.finished.append(state)
            if (output := state.make_output(finished)) is not None:
                outputs.append(output)
        return outputs, stopped
