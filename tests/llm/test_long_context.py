"""Long context: RoPE scaling read from config.json and applied as transformers applies it, checked on
tiny random models at positions past the original context (logits against HF's in the same run)."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from soma_runtime.convert import convert_hf_to_gguf
from soma_runtime.engine.generate.batching import Scheduler
from soma_runtime.engine.generate.engine import Engine
from soma_runtime.errors import PromptTooLong, RequestError
from soma_runtime.tasks import Runtime
from tests.engine.test_batching import run_all
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


@pytest.mark.parametrize("n_ctx", [ORIGINAL, 3 * ORIGINAL])
def test_dynamic_ntk_runs_the_frequencies_transformers_has_at_the_context_length(n_ctx, tmp_path):
    """Dynamic NTK: within the original context the default frequencies; a longer context stretches the
    base as transformers does for a sequence of that length (one set for every token, as the cache needs):
    the first n_ctx - 1 rows of transformers' forward over n_ctx tokens."""
    rope = {"rope_type": "dynamic", "factor": 4.0}
    hf_model, _ = build_model("qwen2", str(tmp_path), rope_scaling=rope, max_position_embeddings=ORIGINAL)
    model = Runtime().load(str(tmp_path), n_ctx=n_ctx, progress=False)
    assert model.context_length == n_ctx and model.info()["max_position"] == 4 * ORIGINAL
    ids = np.random.default_rng(5).integers(0, hf_model.config.vocab_size, n_ctx).tolist()
    with torch.no_grad():
        want = hf_model(torch.tensor([ids])).logits[0, :-1].numpy()
    got = model.logits(ids[:-1])
    assert np.max(np.abs(got - want)) <= 1e-4 * max(1.0, float(np.abs(want).max()))


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


@pytest.fixture(scope="module")
def sliding(tmp_path_factory):
    """A tiny Mistral, every layer attending the last 24 tokens, run with a 32-token context and
    overflow="slide"."""
    directory = str(tmp_path_factory.mktemp("mistral"))
    hf_model, _ = build_model("mistral", directory, sliding_window=24)
    model = Runtime().load(directory, n_ctx=32, overflow="slide", kv_dtype="f32", activations="f32", progress=False)
    return hf_model, model


def hf_logprobs(hf_model, ids: list[int]) -> np.ndarray:
    with torch.no_grad():
        return torch.log_softmax(hf_model(torch.tensor([ids])).logits[0], -1).numpy()


@pytest.mark.parametrize("kv_tokens, pages", [(200, 14), (1, 7)])
def test_a_sliding_window_model_runs_past_its_context_as_transformers_does(sliding, kv_tokens, pages):
    """A prompt and a reply four times the context: each token sees its window, as transformers'
    sliding-window attention has it over the whole sequence; a pool smaller than the sequence runs it,
    since the pages behind the window are let go: even the smallest pool (kv_tokens=1: what one sequence
    holds, its context 32, window 24, rollback and a page 16 each: 6 pages, and the empty one)."""
    hf_model, model = sliding
    ids = np.random.default_rng(3).integers(3, 300, 100).tolist()
    want = hf_logprobs(hf_model, ids)
    got = torch.log_softmax(torch.from_numpy(model.logits(ids)), -1).numpy()
    np.testing.assert_allclose(got, want, atol=1e-4)                   # one forward, 100 rows
    small = Engine(model.loaded.config, model.loaded.weights, model.tokenizer, model.backend, 32, "f32", kv_tokens=kv_tokens)
    small.sliding = True
    got = list(Scheduler(small, thread=False).run(model.request(ids, 40, temperature=0, ignore_eos=True, logprobs=0)))
    assert len(got) == 40 and small.pool.num_pages == pages and small.pool.in_use == 0
    tokens = [t.id for t in got]
    want = hf_logprobs(hf_model, ids + tokens)[len(ids) - 1: -1]
    assert tokens == want.argmax(-1).tolist()
    np.testing.assert_allclose([t.logprob for t in got], want[np.arange(40), tokens], atol=1e-4)


def test_sliding_sequences_speculate_and_batch_as_they_run_alone(sliding):
    """Self-speculation's rejected drafts roll back within the pages kept; batched streams get their solo
    tokens, with each decode step launched ahead or not."""
    hf_model, model = sliding
    rng = np.random.default_rng(4)
    prompts = [rng.integers(3, 300, n).tolist() for n in (84, 70)]
    solo = [[t.id for t in model.generate(p, max_tokens=30, temperature=0, ignore_eos=True)] for p in prompts]
    for p, tokens in zip(prompts, solo):
        assert tokens == hf_logprobs(hf_model, p + tokens)[len(p) - 1: -1].argmax(-1).tolist()
    model.speculate("layers:1")
    try:
        for p, want in zip(prompts, solo):
            assert [t.id for t in model.generate(p, max_tokens=30, temperature=0, ignore_eos=True)] == want
            metrics = model.metrics()
            assert metrics["drafted_tokens"] > metrics["accepted_tokens"] > 0       # rejected drafts rolled back
    finally:
        model.speculate(None)
    for run_ahead in (False, True):
        scheduler = Scheduler(model.engine, max_batch=4, step_tokens=24, run_ahead=run_ahead)
        try:
            assert run_all(scheduler, [model.request(p, 30, temperature=0, ignore_eos=True) for p in prompts]) == solo
            assert scheduler.stats.max_batch == 2
        finally:
            scheduler.close()
    assert model.engine.pool.in_use == 0


def test_slide_needs_a_window_on_every_layer(tmp_path):
    build_model("gemma3_text", str(tmp_path))             # a global layer among local ones
    with pytest.raises(RequestError, match="sliding window"):
        Runtime().load(str(tmp_path), n_ctx=32, overflow="slide", progress=False)
