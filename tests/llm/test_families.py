"""Every decoder family against HF transformers on a tiny random model: logits and greedy tokens."""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from soma_runtime.tasks import Runtime
from tests.fixtures.decoders import FAMILIES, build_model, hf_greedy

PROMPT = "The quick brown fox jumps over the lazy dog. Hello world 123!"


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family(request, tmp_path_factory):
    directory = str(tmp_path_factory.mktemp(request.param))
    model, tok = build_model(request.param, directory)
    ours = Runtime().load(directory, progress=False)
    return request.param, model, tok, ours


def test_logits_match_hf(family):
    name, hf_model, tok, ours = family
    ids = tok.encode(PROMPT).ids
    with torch.no_grad():
        want = hf_model(torch.tensor([ids])).logits[0].numpy()
    got = ours.logits(ids)
    scale = max(1.0, float(np.abs(want).max()))
    assert np.max(np.abs(got - want)) <= 1e-4 * scale, f"{name}: max logit error {np.max(np.abs(got - want)):.3g}"


def test_greedy_tokens_match_hf(family):
    name, hf_model, tok, ours = family
    ids = tok.encode(PROMPT).ids
    want, clear = hf_greedy(hf_model, ids, 32)
    got = [t.id for t in ours.generate(ids, max_tokens=32, temperature=0, ignore_eos=True)]
    assert clear >= 8, f"{name}: the random model has a near-tie at step {clear}; rescale its weights"
    assert got[:clear] == want[:clear], f"{name}: greedy tokens differ within the first {clear} (clear-gap) steps"


def test_bf16_checkpoint_caches_in_bf16(tmp_path):
    """A bf16 checkpoint's KV cache is bf16, as transformers keeps it; logits stay within bf16's rounding
    of HF's f32 run on the same (bf16-valued) weights."""
    hf_model, tok = build_model("llama", str(tmp_path), dtype=torch.bfloat16)
    ours = Runtime().load(str(tmp_path), progress=False)
    assert ours.engine.kv_dtype == "bf16"
    ids = tok.encode(PROMPT).ids
    with torch.no_grad():
        want = hf_model(torch.tensor([ids])).logits[0].numpy()
    got = ours.logits(ids)
    scale = float(np.abs(want).max())
    assert np.max(np.abs(got - want)) <= 5e-3 * scale, f"max logit error {np.max(np.abs(got - want)):.3g} of {scale:.3g}"


def test_a_new_llama_like_family_is_one_registry_entry(tmp_path, monkeypatch):
    """A model_type the registry does not know is refused until one entry names it; then it runs through
    the shared template, its logits transformers' for the llama it is."""
    from soma_runtime.architectures import registry
    from soma_runtime.errors import UnsupportedModelError
    hf_model, tok = build_model("llama", str(tmp_path))
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, "model_type": "llama_next"}))
    with pytest.raises(UnsupportedModelError, match="llama_next"):
        Runtime().load(str(tmp_path), progress=False)
    monkeypatch.setattr(registry, "ARCHITECTURES", dict(registry.ARCHITECTURES))
    monkeypatch.setattr(registry, "BY_GGUF_ARCH", dict(registry.BY_GGUF_ARCH))
    registry.register(registry.ArchSpec("llama_next", "llama_next", registry.LLAMA_LIKE, gguf_rope_style="interleaved"))
    ours = Runtime().load(str(tmp_path), progress=False)
    ids = tok.encode(PROMPT).ids
    with torch.no_grad():
        want = hf_model(torch.tensor([ids])).logits[0].numpy()
    got = ours.logits(ids)
    assert ours.info()["model_type"] == "llama_next"
    assert np.max(np.abs(got - want)) <= 1e-4 * max(1.0, float(np.abs(want).max()))
