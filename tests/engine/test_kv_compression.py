"""Compressed KV caches (quant/kv.py): each codec against a reference dequantization (llama.cpp's own
encoder and decoder from the gguf package for q8_0/q4_0; the documented layout, decoded here, for the
tq kinds), attention over compressed pages against attention (torch) over their dequantized values on
every backend, and a model run on them: prefix caching, batching and the errors of a bad spec."""
from __future__ import annotations

import math

import gguf
import numpy as np
import pytest
import torch

from soma_runtime.backends import run_op
from soma_runtime.engine.generate import calibration
from soma_runtime.engine.generate.batching import Scheduler
from soma_runtime.engine.generate.engine import Engine
from soma_runtime.engine.kv import Sequence
from soma_runtime.errors import RequestError
from soma_runtime.quant import kv
from soma_runtime.tasks import Runtime
from tests.backends import BACKENDS
from tests.engine.test_speculative import run_together
from tests.fixtures.decoders import build_model

CODECS = list(kv.CODECS)
GGML = {"q8_0": gguf.GGMLQuantizationType.Q8_0, "q4_0": gguf.GGMLQuantizationType.Q4_0}


def heads(rows=40, dim=64, seed=0):
    """Head vectors with one channel far larger than the rest, as real keys have."""
    x = np.random.default_rng(seed).standard_normal((rows, dim)).astype(np.float32)
    x[:, 5] *= 12
    return x


def f16_at(block, at):
    return float(np.frombuffer(bytes(block[at:at + 2]), np.float16)[0])


def reference_tq(data: bytes, codec: kv.Codec) -> np.ndarray:
    """One tq row decoded from the module docstring's layout, element by element."""
    out = []
    for start in range(0, len(data), codec.type_size):
        block = data[start:start + codec.type_size]
        scale = f16_at(block, 0)
        book = kv.CODEBOOKS[codec.bits][1 if math.copysign(1, scale) < 0 and scale != 0 else 0]
        values = []
        for j in range(32):
            if codec.bits == 4:
                code = block[2 + j % 16] >> (4 * (j // 16)) & 15
            elif codec.bits == 1:
                code = block[2 + j // 8] >> (j % 8) & 1
            else:
                code = block[2 + j % 8] >> (2 * (j // 8)) & 3
                if codec.bits == 3:
                    code |= (block[10 + j // 8] >> (j % 8) & 1) << 2
            values.append(abs(scale) * float(book[code]))
        if codec.qjl:
            at = 2 + 32 * codec.bits // 8
            signs = np.array([1.0 if block[at + 2 + i // 8] >> (i % 8) & 1 else -1.0 for i in range(32)])
            values = np.array(values) + math.sqrt(math.pi / 2) / 32 * f16_at(block, at) * (kv.SKETCH.T.astype(np.float64) @ signs)
        out.extend(values)
    return np.array(out, np.float32)


@pytest.mark.parametrize("kind", ["q8_0", "q4_0"])
def test_ggml_codecs_are_llama_cpps_blocks(kind):
    x = heads()
    data = kv.encode(kind, x)
    assert np.array_equal(data, gguf.quantize(x, GGML[kind]))
    np.testing.assert_array_equal(kv.decode(kind, data), gguf.dequantize(data, GGML[kind]))


@pytest.mark.parametrize("kind", [k for k in CODECS if kv.CODECS[k].tq])
def test_tq_codecs_decode_as_their_layout_says_and_code_each_block_well(kind):
    codec = kv.CODECS[kind]
    x = heads() @ kv.rotation(64)
    data = kv.encode(kind, x)
    assert data.shape == (40, codec.row_bytes(64))
    decoded = kv.decode(kind, data)
    for row in range(0, 40, 7):
        np.testing.assert_allclose(decoded[row], reference_tq(bytes(data[row]), codec), rtol=1e-5, atol=1e-5)
    if not codec.qjl:       # each block: its codes the nearest levels, its scale the least-squares one for them
        blocks, got = x.reshape(-1, 32), decoded.reshape(-1, 32)
        for block, approx in zip(blocks[:20], got[:20]):
            top = np.abs(block).max()
            best = min(np.sum((block - scale * book[np.abs(block[:, None] / top - book[None]).argmin(1)]) ** 2)
                       for book in kv.CODEBOOKS[codec.bits]
                       for scale in [np.dot(block, book[np.abs(block[:, None] / top - book[None]).argmin(1)])
                                     / np.sum(book[np.abs(block[:, None] / top - book[None]).argmin(1)] ** 2)])
            assert np.sum((block - approx) ** 2) <= best * 1.01 + 1e-6


def test_codebooks_are_lloyds_fixed_points_and_the_rotation_orthogonal():
    for bits, (lloyd, uniform) in kv.CODEBOOKS.items():
        np.testing.assert_allclose(kv.derive_curve(bits, blocks=8000), kv.CURVES[bits], atol=3e-3)
        u = np.linspace(-1, 1, 2 ** bits)
        a, b, c = kv.CURVES[bits]
        np.testing.assert_allclose(lloyd, u * (a + b * u ** 2 + c * u ** 4), atol=1e-6)
        np.testing.assert_allclose(uniform, u, atol=1e-6)
    for dim in (64, 96, 128):
        r = kv.rotation(dim).astype(np.float64)
        np.testing.assert_allclose(r @ r.T, np.eye(dim), atol=1e-5)


def test_rotated_codes_beat_plain_q4_0_on_keys_with_an_outlier_channel():
    x = heads(400)
    rotation = kv.rotation(64)
    error = {kind: np.mean((kv.decode(kind, kv.encode(kind, x @ rotation)) @ rotation.T - x) ** 2) for kind in ("tq4", "tq3")}
    plain = np.mean((kv.decode("q4_0", kv.encode("q4_0", x)) - x) ** 2)
    assert error["tq4"] < 0.5 * plain and error["tq3"] < 2 * plain


def test_qjl_estimates_inner_products_without_bias():
    """Over many blocks, <q, decoded> - <q, x> averages to ~0 with the residual's sketch; tq's own codes
    alone are biased toward zero (their least-squares scale shrinks), which the sketch corrects."""
    rng = np.random.default_rng(3)
    x = rng.standard_normal((20000, 32)).astype(np.float32)
    q = rng.standard_normal((20000, 32)).astype(np.float32)
    truth = np.sum(q * x, axis=1)
    for kind in ("tq3j", "tq2j"):
        error = np.sum(q * kv.decode(kind, kv.encode(kind, x)), axis=1) - truth
        assert abs(error.mean()) < 4 * error.std() / math.sqrt(len(error))


def test_a_spec_sets_each_layers_key_and_value_kinds():
    layout = kv.layout("tq4/tq2,edges=1", 4)
    assert layout.kinds == (("f16", "f16"), ("tq4", "tq2"), ("tq4", "tq2"), ("f16", "f16"))
    assert kv.layout("q8_0", 2).kinds == (("q8_0", "q8_0"),) * 2
    assert kv.bytes_per_token(kv.layout("tq4/tq2", 1).kinds, 2, 64) == 2 * (36 + 20)
    for bad in ("q5_0", "tq4/tq2/tq3", "tq4,edges=x", "tq4,keep=2", "f16/bf16", "tq4/f16"):
        with pytest.raises(ValueError):
            kv.layout(bad, 4)


def paged_inputs(kinds, rows, context, heads_q=4, kv_heads=2, dim=64, seed=0):
    """q, compressed pages holding `context` cached vectors per sequence at scrambled slots, ctx slots and
    spans for `rows` rows split over two sequences (each row causal in its own segment)."""
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((rows, heads_q, dim)).astype(np.float32)
    keys, values = (rng.standard_normal((2 * context, kv_heads, dim)).astype(np.float32) for _ in range(2))
    keys[..., 3] *= 8
    slots = rng.permutation(np.arange(16, 16 + 2 * context))
    pages = []
    for kind, rows_of in zip(kinds, (keys, values)):
        data = np.zeros((2 * context // 16 + 2, 16, kv_heads, kv.CODECS[kind].row_bytes(dim)), np.uint8)
        data.reshape(-1, kv_heads, data.shape[-1])[slots] = kv.encode(kind, rows_of)
        pages.append(data)
    half = rows // 2
    spans = np.array([[0, context - half + 1 + r] for r in range(half)]
                     + [[context, 2 * context - (rows - half) + 1 + r] for r in range(rows - half)], np.int64)
    return q, pages, slots.astype(np.int64), spans


def attention_ref(q, k_pages, v_pages, slots, spans, kinds, scale):
    """torch attention over the pages' dequantized values (the reference's decode), each row its span."""
    keys, values = (torch.from_numpy(kv.decode(kind, p.reshape(-1, *p.shape[2:])[slots])) for kind, p in
                    zip(kinds, (k_pages, v_pages)))
    q = torch.from_numpy(q)
    group = q.shape[1] // keys.shape[1]
    keys, values = keys.repeat_interleave(group, 1), values.repeat_interleave(group, 1)
    scores = torch.einsum("shd,thd->sht", q, keys) * scale
    column = torch.arange(len(slots))[None, None, :]
    spans = torch.from_numpy(spans)
    scores = scores.masked_fill(~((spans[:, :1, None] <= column) & (column < spans[:, 1:, None])), -torch.inf)
    return torch.einsum("sht,thd->shd", torch.softmax(scores, -1), values).numpy()


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("kinds", [("q8_0", "q8_0"), ("q4_0", "q4_0"), ("tq4", "tq4"), ("tq4", "tq2"), ("tq3", "tq3"),
                                   ("tq3j", "tq2")])
@pytest.mark.parametrize("rows", [2, 9, 24])
def test_attention_over_compressed_pages_equals_attention_over_their_dequantized_values(kinds, rows, backend):
    q, (k_pages, v_pages), slots, spans = paged_inputs(kinds, rows, 48)
    got = run_op("paged_attention", q, k_pages, v_pages, slots, None, spans, backend=backend, scale=0.125,
                 k_codec=kinds[0], v_codec=kinds[1])
    np.testing.assert_allclose(got, attention_ref(q, k_pages, v_pages, slots, spans, kinds, 0.125), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("kind", CODECS)
def test_appending_to_a_compressed_cache_writes_each_rows_codes(kind, backend):
    rng = np.random.default_rng(1)
    pages = rng.integers(0, 255, (4, 4, 2, kv.CODECS[kind].row_bytes(64)), dtype=np.uint8)
    new = rng.standard_normal((3, 2, 64)).astype(np.float32)
    slots = np.array([5, 0, 14], np.int64)
    got = run_op("kv_append", pages.copy(), new, slots, backend=backend, codec=kind)
    want = pages.reshape(-1, 2, pages.shape[-1]).copy()
    want[slots] = kv.encode(kind, new)
    assert np.array_equal(got.reshape(want.shape), want)


@pytest.fixture(scope="module")
def smollm2():
    runtime = Runtime("cpu")
    return {kind: runtime.load("default", kv_dtype=kind, progress=False) for kind in ("f16", "tq4/tq3,edges=1", "q8_0")}


PROMPT = "The capital of France is Paris. The capital of Germany is Berlin. The capital of Spain is"


def greedy(model, prompt=PROMPT, tokens=8):
    return [t.id for t in model.generate(prompt, max_tokens=tokens, temperature=0)]


def test_a_compressed_cache_takes_a_fraction_of_the_bytes_and_still_answers(smollm2):
    f16, tq = smollm2["f16"], smollm2["tq4/tq3,edges=1"]
    assert tq.engine.cache.token_bytes() < 0.35 * f16.engine.cache.token_bytes()
    assert "Madrid" in tq.detokenize(greedy(tq))
    ids = f16.tokenize(PROMPT)
    near, exact = smollm2["q8_0"].logits(ids)[-1], f16.logits(ids)[-1]
    assert near.argmax() == exact.argmax() and np.corrcoef(near, exact)[0, 1] > 0.999


def test_prefix_caching_and_batching_work_on_compressed_pages(smollm2):
    """A second request attaches the first's published pages (their bytes as written) and gets the same
    logits; requests batched together get their solo tokens."""
    model = smollm2["tq4/tq3,edges=1"]
    ids = model.tokenize(PROMPT * 3)
    first = model.logits(ids)
    pool = model.engine.pool
    assert pool.by_hash, "the prompt's full pages were published"
    np.testing.assert_array_equal(model.logits(ids)[-1], first[-1])
    prompts = [PROMPT, "Once upon a time", "def fibonacci(n):"]
    solo = [greedy(model, p) for p in prompts]
    scheduler = Scheduler(model.engine, max_batch=4, step_tokens=256, thread=True)
    assert run_together(model, scheduler, prompts, [{}] * 3, 8) == solo
    assert pool.in_use == 0


def test_a_bad_spec_or_head_size_is_a_clear_error(tmp_path):
    runtime = Runtime("cpu")
    with pytest.raises(RequestError, match="kv cache"):
        runtime.load("default", kv_dtype="tq5", progress=False)
    build_model("llama", str(tmp_path))                   # heads 16 wide
    with pytest.raises(RequestError, match="multiple of 32"):
        runtime.load(str(tmp_path), kv_dtype="tq4", progress=False)


def stored_keys(engine, seq, layer):
    """A sequence's keys as a layer's pages hold them, in the model's basis (decoded, turned back)."""
    pages = np.asarray(engine.pool.k[layer][seq.pages])
    kind = engine.cache.layout.kinds[layer][0]
    keys = kv.decode(kind, pages) @ kv.rotation(engine.cfg.head_dim).T if kind in kv.CODECS else pages
    return keys.reshape(-1, *keys.shape[2:])[:seq.length]


def run_prompt(engine, tokens):
    seq = Sequence()
    engine.forward([(seq, tokens, 1)])
    return seq


@pytest.mark.parametrize("how", ["loaded", "recompressed"])
def test_rotated_caches_store_keys_less_their_center_the_mean_key_of_a_fixed_text(tmp_path, how):
    """The center of each layer is its mean key over calibration.TEXT, as a float cache holds them; a tq
    cache (loaded so, or converted from f16 while a sequence runs) stores keys less it, the codes closer
    to the keys than uncentered ones, and a self-speculative draft keeps the target's centers."""
    hf, _ = build_model("qwen2", str(tmp_path), num_attention_heads=2, num_key_value_heads=1, head_dim=32)
    with torch.no_grad():                        # keys offset, as trained models' are in a few channels
        for layer in hf.model.layers:
            layer.self_attn.k_proj.bias[16:] += 3.0
    hf.save_pretrained(str(tmp_path))
    runtime = Runtime("cpu")
    exact = runtime.load(str(tmp_path), kv_dtype="f32", progress=False).engine
    model = runtime.load(str(tmp_path), kv_dtype="f16" if how == "recompressed" else "tq4", progress=False)
    engine = model.engine
    calibration_keys = run_prompt(exact, exact.tokenizer.encode(calibration.TEXT)[:exact.n_ctx - 1])
    tokens = model.tokenize(PROMPT * 2)
    seq = run_prompt(engine, tokens)
    if how == "recompressed":
        assert engine.cache.centers is None, "a float cache needs none"
        engine.recompress("tq4")
    uncentered = Engine(engine.cfg, engine.weights, engine.tokenizer, engine.backend, engine.n_ctx, "tq4", engine.activations,
                        key_centers=tuple(np.zeros_like(c) for c in engine.key_centers))
    plain, reference = run_prompt(uncentered, tokens), run_prompt(exact, tokens)
    for layer in range(engine.cfg.num_layers):
        center = engine.cache.key_center(layer)
        np.testing.assert_allclose(center, stored_keys(exact, calibration_keys, layer).mean(axis=0), rtol=1e-5, atol=1e-5)
        keys = stored_keys(exact, reference, layer)
        error = np.sum((stored_keys(engine, seq, layer) + center - keys) ** 2)
        assert error < 0.6 * np.sum((stored_keys(uncentered, plain, layer) - keys) ** 2)
    draft = engine.first_layers(1)
    assert draft.cache.key_center(0) is engine.cache.key_center(0)


def test_soft_capped_scores_keep_keys_uncentered(tmp_path):
    """Gemma 2 caps its scores (tanh): a shift of every score would change its softmax, so no center."""
    build_model("gemma2", str(tmp_path), num_attention_heads=2, num_key_value_heads=1, head_dim=32)
    model = Runtime("cpu").load(str(tmp_path), kv_dtype="tq4", progress=False)
    assert model.engine.cfg.attn_softcap and model.engine.cache.centers is None
