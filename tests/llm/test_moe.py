"""Mixture-of-experts decoders (Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE) on tiny random models: logits and
greedy tokens against transformers, alone and two prompts batched; GGUFs written with llama.cpp's names
against llama.cpp; quantized experts decoded in the kernel; files whose experts disagree with their config."""
from __future__ import annotations

import json
import queue

import gguf
import numpy as np
import pytest
import torch

from soma_runtime.backends import run_op
from soma_runtime.convert import convert_hf_to_gguf
from soma_runtime.dtypes import DTYPES, F16_FIELDS, QTensor
from soma_runtime.engine.generate.batching import Scheduler
from soma_runtime.errors import ModelLoadError
from soma_runtime.ir.jets import REGISTRY
from soma_runtime.quant import quantize
from soma_runtime.tasks import Runtime
from tests.fixtures.decoders import MOE_FAMILIES, build_model, hf_greedy
from tests.llm.llama_reference import check_greedy, llama_greedy, near_tie

PROMPTS = ["The quick brown fox jumps over the lazy dog. Hello world 123!", "Numbers 12345 and symbols appear too."]
STEPS = 64


@pytest.fixture(scope="module", params=sorted(MOE_FAMILIES))
def family(request, tmp_path_factory):
    root = tmp_path_factory.mktemp(request.param)
    model, tok = build_model(request.param, str(root / "hf"))
    return request.param, root, model, tok, Runtime().load(str(root / "hf"), progress=False)


def greedy(model, ids, n):
    return [t.id for t in model.generate(ids, max_tokens=n, temperature=0, ignore_eos=True)]


def test_logits_match_hf(family):
    name, _, hf_model, tok, ours = family
    ids = tok.encode(PROMPTS[0]).ids
    with torch.no_grad():
        want = hf_model(torch.tensor([ids])).logits[0].numpy()
    got = ours.logits(ids)
    scale = max(1.0, float(np.abs(want).max()))
    assert np.max(np.abs(got - want)) <= 1e-4 * scale, f"{name}: max logit error {np.max(np.abs(got - want)):.3g}"
    assert not {op for op, _ in REGISTRY.missed("cpu")} & {"router", "moe_ffn"}, "routing ran by its atoms, not its jets"


def test_greedy_tokens_match_hf(family):
    name, _, hf_model, tok, ours = family
    ids = tok.encode(PROMPTS[0]).ids
    want, clear = hf_greedy(hf_model, ids, STEPS)
    got = greedy(ours, ids, STEPS)
    same = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), STEPS)
    print(f"{name}: {same} of {STEPS} greedy tokens identical to HF's ({clear} before its first top-2 gap under 1e-3)")
    assert clear >= 8, f"{name}: the random model has a near-tie at step {clear}; rescale its weights"
    assert got[:clear] == want[:clear], f"{name}: greedy tokens differ within the first {clear} (clear-gap) steps"


def test_two_prompts_batched_get_hf_tokens(family):
    """Two prompts decoded in one batch (their rows routed together) each get their solo tokens, which are HF's."""
    name, _, hf_model, tok, ours = family
    prompts = [tok.encode(p).ids for p in PROMPTS]
    solo = [greedy(ours, ids, 32) for ids in prompts]
    inbox, got = queue.Queue(), [[], []]
    scheduler = Scheduler(ours.engine, max_batch=2)
    try:
        for i, ids in enumerate(prompts):
            scheduler.submit(ours.request(ids, 32, temperature=0, ignore_eos=True), lambda item, i=i: inbox.put((i, item)))
        done = 0
        while done < 2:
            i, item = inbox.get(timeout=120)
            assert not isinstance(item, Exception), item
            done += item is None
            if item is not None:
                got[i].append(item.id)
        assert scheduler.stats.max_batch == 2
    finally:
        scheduler.close()
    assert got == solo, f"{name}: batched tokens differ from solo ones"
    for ids, tokens in zip(prompts, got):
        want, clear = hf_greedy(hf_model, ids, 32)
        assert tokens[:clear] == want[:clear], f"{name}: batched tokens differ from HF within {clear} clear steps"


def test_speculative_and_prefix_cached_decoding_keep_the_plain_tokens(family):
    """Drafts verified in one step (rows of a sequence routed together) and a prompt served from cached
    pages give the plain greedy tokens."""
    name, _, _, tok, ours = family
    ids = tok.encode(PROMPTS[0] + " " + PROMPTS[0]).ids
    plain = greedy(ours, ids, 32)
    for draft in ("prompt-lookup", "layers:1"):
        ours.speculate(draft)
        try:
            assert greedy(ours, ids, 32) == plain, f"{name}: {draft} drafts changed the tokens"
            assert ours.metrics()["drafted_tokens"] > 0
        finally:
            ours.speculate(None)
    assert greedy(ours, ids, 32) == plain and ours.metrics()["cached_tokens"] > 0


@pytest.mark.parametrize("family_name, config", [("qwen2_moe", {"mlp_only_layers": [0]}),
                                                 ("qwen3_moe", {"decoder_sparse_step": 2}),
                                                 ("qwen3_moe", {"torch_dtype": "bfloat16"})])
def test_dense_layers_and_bf16_experts_match_hf(tmp_path, family_name, config):
    """Layers that keep a dense MLP (mlp_only_layers, decoder_sparse_step), and bf16 experts (with an f32
    KV cache: a bf16 one rounds the values a router reads, enough to flip a random router's top-2; HF's
    rope frequencies went through bf16 in this checkpoint, hence its wider tolerance, as for the dense one)."""
    dtype = torch.bfloat16 if config.pop("torch_dtype", None) else torch.float32
    hf_model, tok = build_model(family_name, str(tmp_path), dtype=dtype, **config)
    ours = Runtime().load(str(tmp_path), progress=False, kv_dtype="f32")
    ids = tok.encode(PROMPTS[0]).ids
    with torch.no_grad():
        want = hf_model(torch.tensor([ids])).logits[0].numpy()
    scale = max(1.0, float(np.abs(want).max()))
    tol = 5e-3 if dtype == torch.bfloat16 else 1e-4
    assert np.max(np.abs(ours.logits(ids) - want)) <= tol * scale


def test_f32_gguf_matches_its_safetensors_form(family):
    _, root, _, tok, _ = family
    path = convert_hf_to_gguf(str(root / "hf"), str(root / "model.f32.gguf"), "f32")
    exact = {"kv_dtype": "f32", "activations": "f32", "progress": False}
    ids = tok.encode(PROMPTS[0]).ids
    np.testing.assert_allclose(Runtime().load(path, **exact).logits(ids), Runtime().load(str(root / "hf"), **exact).logits(ids),
                               atol=2e-4, rtol=0)


@pytest.mark.parametrize("kind", ["q8_0", "q4_0"])
def test_quantized_gguf_matches_llama_cpp(family, kind):
    """Merged ffn_*_exps blocks, routers f32, as llama.cpp's converter writes them: the same greedy tokens
    as llama-cpp-python on the same file, up to its near-ties."""
    from llama_cpp import Llama
    name, root, _, tok, _ = family
    path = convert_hf_to_gguf(str(root / "hf"), str(root / f"model.{kind}.gguf"), kind)
    ids = tok.encode(PROMPTS[0]).ids
    llama = Llama(model_path=path, n_ctx=256, n_threads=2, verbose=False, logits_all=True)
    want = llama_greedy(llama, ids, 32)
    got = greedy(Runtime().load(path, progress=False), ids, len(want.tokens))
    check_greedy(f"{name} {kind}", got, want, near_tie([want]))


def random_blocks(rng, kind: str, shape: tuple[int, ...]) -> QTensor:
    """Merged experts of `shape` in `kind`: encoded where we can encode it, else random blocks whose f16
    scales are small and finite (the K-quants of real Q4_K_M files)."""
    if kind in ("q4_0", "q4_1", "q8_0"):
        return quantize(rng.standard_normal(shape).astype(np.float32) * 0.1, kind)
    block = DTYPES[kind]
    blocks = rng.integers(0, 256, size=(int(np.prod(shape)) // block.block_size, block.type_size), dtype=np.uint8)
    for offset in F16_FIELDS[kind]:
        blocks[:, offset:offset + 2] = (rng.standard_normal((len(blocks), 1)) * 0.005).astype(np.float16).view(np.uint8)
    return QTensor(blocks.reshape(-1), kind, shape)


@pytest.mark.parametrize("kind", ["q4_0", "q4_1", "q8_0", "q2_K", "q3_K", "q4_K", "q5_K", "q6_K"])
def test_quantized_experts_match_their_dequantized_atoms(kind):
    """The CPU jet's per-expert products on stored blocks (q8 activations) against the op's dense atoms."""
    rng = np.random.default_rng(0)
    experts, tokens, hidden, ffn = 6, 5, 256, 256
    x = rng.standard_normal((tokens, hidden)).astype(np.float32)
    chosen = np.stack([rng.permutation(experts)[:2] for _ in range(tokens)]).astype(np.int64)
    weights = rng.random((tokens, 2)).astype(np.float32)
    gate, up, down = (random_blocks(rng, kind, shape)
                      for shape in ((experts, ffn, hidden), (experts, ffn, hidden), (experts, hidden, ffn)))
    inputs = (x, weights, chosen, gate, up, down)
    want = run_op("moe_ffn", *inputs, backend="reference")
    for activations, tol in (("f32", 1e-4), ("q8", 3e-2)):
        got = run_op("moe_ffn", *inputs, backend="cpu", activations=activations)
        scale = max(1.0, float(np.abs(want).max()))
        assert np.abs(got - want).max() <= tol * scale, f"{kind}, {activations} activations"


def test_gguf_with_a_tensor_per_expert_loads_as_merged(family, tmp_path, monkeypatch):
    """llama.cpp's older MoE files (`blk.N.ffn_gate.E.weight`, one tensor per expert; the llama.cpp here no
    longer reads them): merged at load, the logits of the merged file exactly."""
    _, root, _, tok, _ = family
    merged = convert_hf_to_gguf(str(root / "hf"), str(tmp_path / "merged.gguf"), "q8_0")
    add_tensor = gguf.GGUFWriter.add_tensor

    def per_expert(self, tensor_name, tensor, raw_shape=None, raw_dtype=None):
        if "_exps." not in tensor_name:
            return add_tensor(self, tensor_name, tensor, raw_shape=raw_shape, raw_dtype=raw_dtype)
        shape = raw_shape or tensor.shape
        for e, part in enumerate(np.asarray(tensor).reshape(shape)):
            add_tensor(self, tensor_name.replace("_exps.", f".{e}."), np.ascontiguousarray(part), raw_shape=shape[1:],
                       raw_dtype=raw_dtype)
    monkeypatch.setattr(gguf.GGUFWriter, "add_tensor", per_expert)
    split = convert_hf_to_gguf(str(root / "hf"), str(tmp_path / "split.gguf"), "q8_0")
    monkeypatch.undo()
    ids = tok.encode(PROMPTS[0]).ids
    ours = Runtime().load(split, progress=False)
    np.testing.assert_array_equal(ours.logits(ids), Runtime().load(merged, progress=False).logits(ids))


@pytest.mark.parametrize("kind", ["q4_0", "q4_1", "q8_0"])
@pytest.mark.parametrize("tokens", [1, 3, 19])
def test_grouped_q8_experts_are_the_per_expert_q8_matmuls(kind, tokens):
    """Every chosen expert in one pass (q8 block dots) gives what each expert's own q8 matmuls give."""
    rng = np.random.default_rng(1)
    experts, hidden, ffn, k = 8, 128, 96, 3
    x = rng.standard_normal((tokens, hidden)).astype(np.float32)
    chosen = np.stack([rng.permutation(experts)[:k] for _ in range(tokens)]).astype(np.int64)
    weights = rng.random((tokens, k)).astype(np.float32)
    stacked = [rng.standard_normal(shape).astype(np.float32) * 0.1
               for shape in ((experts, ffn, hidden), (experts, ffn, hidden), (experts, hidden, ffn))]
    gate, up, down = (quantize(w, kind) for w in stacked)
    got = run_op("moe_ffn", x, weights, chosen, gate, up, down, backend="cpu", activations="q8")

    def linear(a, w, e):
        return run_op("matmul", a, quantize(w[e], kind), backend="cpu", transpose_b=True, activations="q8")
    want = np.zeros_like(x)
    for t in range(tokens):
        for e in sorted(chosen[t]):
            h = x[t:t + 1]
            hidden_rows = run_op("swiglu", linear(h, stacked[0], e), linear(h, stacked[1], e), backend="cpu")
            want[t] += weights[t, list(chosen[t]).index(e)] * linear(hidden_rows, stacked[2], e)[0]
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-5 * max(1.0, float(np.abs(want).max())))


@pytest.fixture(scope="module")
def tiny_qwen2_moe(tmp_path_factory):
    directory = tmp_path_factory.mktemp("bad") / "hf"
    build_model("qwen2_moe", str(directory), num_hidden_layers=1)
    return directory


def converted_with(monkeypatch, directory, out, **overrides):
    """The model converted to GGUF with these metadata writers' values replaced (a file that lies)."""
    for method, value in overrides.items():
        original = getattr(gguf.GGUFWriter, method)
        monkeypatch.setattr(gguf.GGUFWriter, method, lambda self, _, o=original, v=value: o(self, v))
    return convert_hf_to_gguf(str(directory), str(out), "q8_0")


def test_gguf_whose_expert_count_disagrees_with_its_tensors_is_refused(tiny_qwen2_moe, tmp_path, monkeypatch):
    path = converted_with(monkeypatch, tiny_qwen2_moe, tmp_path / "lies.gguf", add_expert_count=16)
    monkeypatch.undo()
    with pytest.raises(ModelLoadError, match=r"ffn_gate_inp.weight' holds 8 experts, the config says 16 \(expert_count\)"):
        Runtime().load(path, progress=False)


def test_gguf_with_top_k_beyond_its_experts_is_refused(tiny_qwen2_moe, tmp_path, monkeypatch):
    path = converted_with(monkeypatch, tiny_qwen2_moe, tmp_path / "lies.gguf", add_expert_used_count=9)
    monkeypatch.undo()
    with pytest.raises(ModelLoadError, match="top-k of 9 experts per token exceeds the 8 experts"):
        Runtime().load(path, progress=False)


def test_hf_config_with_top_k_beyond_its_experts_is_refused(tiny_qwen2_moe):
    config = json.loads((tiny_qwen2_moe / "config.json").read_text())
    (tiny_qwen2_moe / "config.json").write_text(json.dumps({**config, "num_experts_per_tok": 12}))
    try:
        with pytest.raises(ModelLoadError, match=r"config.json: top-k of 12 experts per token exceeds the 8 experts"):
            Runtime().load(str(tiny_qwen2_moe), progress=False)
    finally:
        (tiny_qwen2_moe / "config.json").write_text(json.dumps(config))


def test_hf_checkpoint_missing_an_expert_is_refused(tiny_qwen2_moe, tmp_path):
    from safetensors.numpy import load_file, save_file
    tensors = load_file(str(tiny_qwen2_moe / "model.safetensors"))
    del tensors["model.layers.0.mlp.experts.3.up_proj.weight"]
    broken = tmp_path / "hf"
    broken.mkdir()
    for f in tiny_qwen2_moe.iterdir():
        if f.name != "model.safetensors":
            (broken / f.name).write_bytes(f.read_bytes())
    save_file(tensors, str(broken / "model.safetensors"))
    with pytest.raises(ModelLoadError, match="ffn_up_exps.weight lacks expert 3"):
        Runtime().load(str(broken), progress=False)
