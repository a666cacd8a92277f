"""A Hugging Face directory's weights: its safetensors files (those model.safetensors.index.json names, else every
one there), or where it has none, PyTorch's pickled ones (pytorch_model.bin, or the shards
pytorch_model.bin.index.json names), read without running them (pytorch.py). Knows file names and formats'
readers; nothing of models."""
from __future__ import annotations

import os

from soma_runtime.errors import ModelLoadError
from soma_runtime.loaders.pytorch import read_pytorch
from soma_runtime.loaders.safetensors import read_safetensors
from soma_runtime.text.tokenizer import read_json

INDEXES = (("model.safetensors.index.json", ".safetensors"), ("pytorch_model.bin.index.json", ".bin"))
PYTORCH_FILES = ("pytorch_model.bin", "model.pt", "model.pth")


def plain_file_name(name) -> bool:
    """A name of a file in the directory itself (no path that could lead out of it)."""
    return isinstance(name, str) and name not in ("", ".", "..") and os.path.basename(name) == name


def checkpoint_files(directory: str) -> list[str]:
    """The weight files of a HF directory: those its index names, else every .safetensors file there, else its
    PyTorch checkpoint."""
    for index_name, _ in INDEXES:
        index = os.path.join(directory, index_name)
        if os.path.isfile(index):
            weight_map = read_json(index).get("weight_map")
            if not isinstance(weight_map, dict) or not all(map(plain_file_name, weight_map.values())):
                raise ModelLoadError(f"{index}: weight_map must map tensor names to file names in the directory")
            return sorted(set(weight_map.values()))
    names = os.listdir(directory)
    files = sorted(n for n in names if n.endswith(".safetensors")) or [n for n in PYTORCH_FILES if n in names][:1]
    if not files:
        raise ModelLoadError(f"{directory}: no weights found (.safetensors, or {' or '.join(PYTORCH_FILES)})")
    return files


def read_checkpoint(directory: str) -> dict[str, object]:
    """All tensors of a HF directory, each read in place (mmapped), by name."""
    tensors = {}
    for name in checkpoint_files(directory):
        path = os.path.join(directory, name)
        tensors.update(read_safetensors(path) if name.endswith(".safetensors") else read_pytorch(path))
    return tensors
