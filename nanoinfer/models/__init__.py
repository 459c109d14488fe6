"""Model architectures by their Hugging Face `architectures` name."""
from nanoinfer.config import SUPPORTED_ARCHITECTURES
from nanoinfer.models.llama import LlamaForCausalLM

# Llama, Qwen2 and Qwen3: one decoder (llama.py)
MODEL_REGISTRY = dict.fromkeys(SUPPORTED_ARCHITECTURES, LlamaForCausalLM)
