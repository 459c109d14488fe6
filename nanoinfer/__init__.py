"""nanoinfer: a minimal, readable and fast LLM inference engine."""
from nanoinfer.entrypoints.llm import LLM
from nanoinfer.outputs import CompletionOutput, RequestOutput
from nanoinfer.sampling_params import SamplingParams

__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput"]
