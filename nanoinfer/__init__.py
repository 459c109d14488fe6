"""nanoinfer: a minimal, readable and fast LLM inference engine."""
from nanoinfer.entrypoints.llm import LLM
from nanoinfer.outputs import CompletionOutput, Logprob, RequestOutput
from nanoinfer.sampling_params import RequestOutputKind, SamplingParams

__all__ = ["LLM", "SamplingParams", "RequestOutputKind", "RequestOutput", "CompletionOutput", "Logprob"]
