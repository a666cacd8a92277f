"""Weight integrity (SPEC "security"): the sha256 a model is pinned by, checked before it loads, and
the check that its weights hold no NaN or infinity.

A file's digest is its sha256. A directory's digest is taken over its weight files (the safetensors
files a Hugging Face directory's index names, or all of them; the files a soma config.toml lists):
the sha256 of the lines `<file sha256>  <file name>\n` in name order, which is what
`sha256sum <the files, sorted> | sha256sum` prints. `soma-runtime models hash PATH` prints it.
Which files a format holds its weights in is the loaders' to say; this module knows no format.
"""
from __future__ import annotations

import hashlib
import itertools
import os
import re

from soma_runtime.errors import ModelLoadError
from soma_runtime.quant.finite import nonfinite

HEX_DIGEST = re.compile(r"[0-9a-fA-F]{64}")
READ_BLOCK = 1 << 24


def file_sha256(path: str) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(READ_BLOCK), b""):
            digest.update(block)
    return digest.hexdigest()


def files_digest(directory: str, names: list[str]) -> str:
    """The digest of a directory's weight files (see the module's docstring)."""
    lines = "".join(f"{file_sha256(os.path.join(directory, name))}  {name}\n" for name in sorted(names))
    return hashlib.sha256(lines.encode()).hexdigest()


def check_digest_text(expected: str) -> str:
    if not isinstance(expected, str) or not HEX_DIGEST.fullmatch(expected):
        raise ModelLoadError(f"a sha256 must be 64 hexadecimal digits, got {expected!r}")
    return expected.lower()


def verify_pinned(directory: str, pins, source: str) -> None:
    """Each file a soma config.toml pins (`[weights] sha256 = {file = digest}`) has its digest."""
    if not isinstance(pins, dict):
        raise ModelLoadError(f"{source}: [weights] sha256 must map file names to digests")
    for name, expected in pins.items():
        path = os.path.join(directory, name)
        if os.path.basename(name) != name or not os.path.isfile(path):
            raise ModelLoadError(f"{source}: pins {name!r}, which is not a file of the directory")
        got = file_sha256(path)
        if got != check_digest_text(expected):
            raise ModelLoadError(f"{path}: sha256 {got} does not match {expected}, pinned in {source}; refusing to load it")


def check_disjoint(spans: list[tuple[int, int, str]], path: str) -> None:
    """Tensors' byte ranges (start, end, name) in a file never overlap (one tensor cannot alias another)."""
    for (_, end, first), (start, _, second) in itertools.pairwise(sorted(spans)):
        if start < end:
            raise ModelLoadError(f"{path}: tensors {first!r} and {second!r} overlap")


def check_finite(weights) -> None:
    """ModelLoadError naming the first tensor holding a NaN or an infinity."""
    for name, tensor in weights.tensors.items():
        if nonfinite(tensor):
            raise ModelLoadError(f"{weights.source}: tensor {name!r} holds NaN or infinite values")

