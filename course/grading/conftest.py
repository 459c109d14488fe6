"""What the grading tests share: tiny random models made on the spot, and the reference outputs.

No weights are downloaded. A tiny Llama (2 layers, hidden size 64, a 512-token byte-level BPE
vocabulary trained on a few sentences) is saved as a Hugging Face folder once per run; the
engine's outputs are compared with transformers' own on it, in float32 on the CPU. Each test
file is one assignment; each test function is one criterion, named by its docstring's first
line, and passes only if the behaviour it names is right.
"""
import functools
import importlib.util
import os

import torch

if not torch.cuda.is_available():   # Triton kernels run under the interpreter on the CPU
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
from hypothesis import Phase, settings  # noqa: E402

# A failing property test reports the first failing example it finds, without looking for a
# smaller one: shrinking took longer than the rest of a check.
settings.register_profile("grading", phases=[Phase.explicit, Phase.reuse, Phase.generate])
settings.load_profile("grading")

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def project_fixtures():
    """tests/conftest.py, the project's own: its tiny models and transformers' reference
    outputs (`save_model`, `hf_greedy`, `hf_logits`, `make_tokenizer`, `random_prompts`)."""
    spec = importlib.util.spec_from_file_location("project_fixtures",
                                                  os.path.join(ROOT, "tests", "conftest.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


fixtures = project_fixtures()
VOCAB_SIZE, save_model, hf_greedy = fixtures.VOCAB_SIZE, fixtures.save_model, fixtures.hf_greedy
hf_logits, make_tokenizer, random_prompts = (fixtures.hf_logits, fixtures.make_tokenizer,
                                             fixtures.random_prompts)


@pytest.fixture(autouse=True)
def engine_on_cpu_unless_gpu_test(request, monkeypatch):
    """The reference runs are float32 on the CPU, so the engine runs there too; a test marked
    `gpu` chooses its own device."""
    if request.node.get_closest_marker("gpu") is None:
        import nanoinfer.entrypoints.llm as llm_module
        monkeypatch.setattr(llm_module, "Config", functools.partial(llm_module.Config,
                                                                     device="cpu"))
    yield


@pytest.fixture(scope="session")
def llama_dir(tmp_path_factory) -> str:
    """A tiny random Llama, saved as a Hugging Face folder."""
    return save_model("llama", str(tmp_path_factory.mktemp("models") / "llama"))


@pytest.fixture(scope="session")
def qwen3_dir(tmp_path_factory) -> str:
    """A tiny random Qwen3 (per-head q/k norms, head_dim 32)."""
    return save_model("qwen3", str(tmp_path_factory.mktemp("models") / "qwen3"))
