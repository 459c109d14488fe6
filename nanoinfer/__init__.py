"""nanoinfer: a minimal, readable and fast LLM inference engine."""
from nanoinfer.entrypoints.llm import LLM
from nanoinfer.outputs import CompletionOutput, Logprob, RequestOutput
from nanoinfer.sampling_params import GuidedDecodingParams, RequestOutputKind, SamplingParams

__all__ = ["LLM", "SamplingParams", "GuidedDecodingParams", "RequestOutputKind", "RequestOutput",
           "CompletionOutput", "Logprob"]
