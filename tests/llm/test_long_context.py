"""Long context: RoPE scaling read from config.json and applied as transformers applies it, checked on
tiny random models at positions past the original context (logits against HF's in the same run)."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from soma_runtime.api import Runtime
from soma_runtime.convert import convert_hf_to_gguf
from soma_runtime.errors import PromptTooLong
from tests.fixtures.decoders import build_model

ORIGINAL = 32          # the "pretrained" context the scaling stretches
SCALINGS = {
    "linear": {"rope_type": "linear", "factor": 4.0},
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": ORIGINAL},
    "yarn-betas": {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": ORIGINAL, "beta_fast": 16.0,
                   "beta_slow": 2.0, "truncate": False},
    "yarn-mscale": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": ORIGINAL, "mscale": 0.707,
                    "mscale_all_dim": 1.0},
    "yarn-attention-factor": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": ORIGINAL,
                              "attention_factor": 1.3},
}


@pytest.mark.parametrize("scaling", sorted(SCALINGS))
def test_rope_scaling_matches_transformers_past_the_original_context(scaling, tmp_path):
    hf_model, _ = build_model("qwen2", str(tmp_path), rope_scaling=SCALINGS[scaling], max_position_embeddings=256)
    assert hf_model.config.rope_parameters["rope_type"] == SCALINGS[scaling]["rope_type"]      # HF read it too
    ids = np.random.default_rng(0).integers(0, hf_model.config.vocab_size, 4 * ORIGINAL).tolist()
    with torch.no_grad():
        want = hf_model(torch.tensor([ids])).logits[0].numpy()
    got = Runtime().load(str(tmp_path), progress=False).logits(ids)
    scale = max(1.0, float(np.abs(want).max()))
    assert np.max(np.abs(got - want)) <= 1e-4 * scale, f"{scaling}: max logit error {np.max(np.abs(got - want)):.3g}"


@pytest.mark.parametrize("scaling", ["linear", "yarn", "yarn-betas-truncated"])
def test_rope_scaled_gguf_matches_llama_cpp(scaling, tmp_path):
    """The scaling written to GGUF as llama.cpp reads it: the same logits as llama.cpp's, and as our run of
    the safetensors form, past the original context."""
    from llama_cpp import Llama
    rope = {**SCALINGS.get(scaling, SCALINGS["yarn-betas"]), "truncate": True}
    build_model("qwen2", str(tmp_path / "hf"), rope_scaling=rope, max_position_embeddings=256)
    path = convert_hf_to_gguf(str(tmp_path / "hf"), str(tmp_path / "model.gguf"), "f32")
    ids = np.random.default_rng(1).integers(0, 300, 4 * ORIGINAL).tolist()
    exact = {"kv_dtype": "f32", "activations": "f32", "progress": False}
    ours = Runtime().load(path, **exact).logits(ids)
    np.testing.assert_allclose(ours, Runtime().load(str(tmp_path / "hf"), **exact).logits(ids), atol=2e-4, rtol=0)
    # llama-cpp-python passes its own YaRN betas (32, 1), which override the file's: given as the file has them
    llama = Llama(model_path=path, n_ctx=256, n_threads=2, verbose=False, logits_all=True,
                  yarn_beta_fast=rope.get("beta_fast", 32.0), yarn_beta_slow=rope.get("beta_slow", 1.0))
    llama.eval(ids)
    want = np.array(llama.scores[: len(ids)])
    assert np.max(np.abs(ours - want)) <= 1e-3 * max(1.0, float(np.abs(want).max()))


@pytest.fixture(scope="module")
def small_context(tmp_path_factory):
    """A tiny model run with a 64-token context."""
    directory = str(tmp_path_factory.mktemp("llama"))
    build_model("llama", directory)
    return Runtime().load(directory, n_ctx=64, progress=False)


def test_a_prompt_beyond_the_context_is_an_error_or_its_newest_tokens(small_context):
    model = small_context
    ids = np.random.default_rng(2).integers(3, 300, 200).tolist()
    with pytest.raises(PromptTooLong):
        model.complete(ids, max_tokens=4, temperature=0)
    model.overflow = "truncate"
    try:
        kept = model.truncated(ids)
        assert kept == ids[-48:]                   # three quarters of 64
        got = [t.id for t in model.generate(ids, max_tokens=8, temperature=0, ignore_eos=True)]
        assert got == [t.id for t in model.generate(ids[-48:], max_tokens=8, temperature=0, ignore_eos=True)]
        text = "The quick brown fox jumps over the lazy dog. " * 40
        assert model.complete(text, max_tokens=4, temperature=0) == model.complete(
            model.truncated(model.tokenize(text)), max_tokens=4, temperature=0)
    finally:
        model.overflow = "error"


def test_a_long_conversation_drops_its_oldest_messages_keeping_the_system_prompt(small_context):
    model = small_context
    system = {"role": "system", "content": "Hi."}
    turns = [{"role": r, "content": f"n{i}"}
             for i, r in zip(range(11), ["user", "assistant"] * 6)]
    with pytest.raises(PromptTooLong):
        model.chat([system, *turns], max_tokens=4, temperature=0, stream=False)
    model.overflow = "truncate"
    try:
        turn = model.turn([system, *turns])
        assert turn.text.startswith(model.chat_prompt([system])[:20]) and "Hi." in turn.text
        assert "\nn10<" in turn.text and "\nn0<" not in turn.text
        assert len(model.turn_ids(turn)) <= 48
        kept = [m for m in turns if f"\n{m['content']}<" in turn.text]
        assert kept == turns[-len(kept):]            # the newest ones, in order
        assert model.chat([system, *turns], max_tokens=4, temperature=0, stream=False) == \
            model.chat([system, *kept], max_tokens=4, temperature=0, stream=False)
    finally:
        model.overflow = "error"
