"""Tiny models converted to GGUF: f32/f16 give the tokens of their safetensors form, q8_0 llama.cpp's."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from soma_runtime.convert import convert_hf_to_gguf
from soma_runtime.tasks import Runtime
from tests.fixtures.decoders import build_model
from tests.llm.llama_reference import check_greedy, llama_greedy, near_tie

FAMILIES = ["llama", "qwen2", "qwen3", "gemma", "phi3"]
PROMPT = "The quick brown fox jumps over the lazy dog. Hello world 123!"


def greedy(model, ids, n=32):
    return [t.id for t in model.generate(ids, max_tokens=n, temperature=0, ignore_eos=True)]


@pytest.fixture(scope="module", params=FAMILIES)
def converted(request, tmp_path_factory):
    family = request.param
    root = tmp_path_factory.mktemp(family)
    _, tok = build_model(family, str(root / "f32"))
    build_model(family, str(root / "f16"), dtype=torch.float16)
    files = {t: convert_hf_to_gguf(str(root / src), str(root / f"model.{t}.gguf"), t)
             for t, src in (("f32", "f32"), ("f16", "f16"), ("q8_0", "f32"))}
    return family, root, tok.encode(PROMPT).ids, files


@pytest.mark.parametrize("kind", ["f32", "f16"])
def test_float_gguf_matches_its_safetensors_form(converted, kind):
    _, root, ids, files = converted
    exact = {"kv_dtype": "f32", "activations": "f32", "progress": False}
    from_gguf = Runtime().load(files[kind], **exact)
    from_safetensors = Runtime().load(str(root / kind), **exact)
    np.testing.assert_allclose(from_gguf.logits(ids), from_safetensors.logits(ids), atol=2e-4, rtol=0)
    assert greedy(from_gguf, ids) == greedy(from_safetensors, ids)


def test_q8_0_gguf_matches_llama_cpp(converted):
    from llama_cpp import Llama
    family, _, ids, files = converted
    llama = Llama(model_path=files["q8_0"], n_ctx=256, n_threads=2, verbose=False, logits_all=True)
    want = llama_greedy(llama, ids, 32)
    got = greedy(Runtime().load(files["q8_0"], progress=False), ids, len(want.tokens))
    check_greedy(f"{family} q8_0", got, want, near_tie([want]))
