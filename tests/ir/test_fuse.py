"""The fuse pass. Recognition: graphs of primitive ops, as exporters write them, become the fused op
whose formula they are (in either exporter's style), with the same results; graphs that differ are
left alone. Rules: a decoder written as plain math becomes the fused graph today's kernels run."""
from __future__ import annotations

import copy
import math
from collections import Counter

import numpy as np
import pytest

from soma_runtime.backends import get
from soma_runtime.ir.builder import GraphBuilder
from soma_runtime.ir.passes import fuse
from soma_runtime.ir.plan import Plan

CPU = get("cpu")
RNG = np.random.default_rng(0)


def scalar(g, name, value):
    return g.const(name, np.full((), value, np.float32))


def layernorm_pow_div(g, x, w, b, eps=1e-5):
    """torch.onnx's decomposed LayerNorm: ReduceMean, Sub, Pow 2, ReduceMean, Add eps, Sqrt, Div, Mul, Add."""
    d = g.sub(x, g.reduce_mean(x, axes=(-1,), keepdims=True))
    var = g.reduce_mean(g.pow(d, scalar(g, "two", 2.0)), axes=(-1,), keepdims=True)
    return g.add(g.mul(g.div(d, g.sqrt(g.add(var, scalar(g, "eps", eps)))), w), b)


def layernorm_rsqrt_mul(g, x, w, b, eps=1e-5):
    """Another exporter's: Mul for the square, Rsqrt, products in another order, the bias first."""
    d = g.add(g.mul(g.reduce_mean(x, axes=(-1,), keepdims=True), scalar(g, "minus", -1.0)), x)
    var = g.reduce_mean(g.mul(d, d), axes=(-1,), keepdims=True)
    return g.add(b, g.mul(w, g.mul(g.rsqrt(g.add(scalar(g, "eps", eps), var)), d)))


def layernorm_eps_outside(g, x, w, b, eps=1e-5):
    """Not a layernorm: epsilon added after the square root."""
    d = g.sub(x, g.reduce_mean(x, axes=(-1,), keepdims=True))
    var = g.reduce_mean(g.mul(d, d), axes=(-1,), keepdims=True)
    return g.add(g.mul(g.div(d, g.add(g.sqrt(var), scalar(g, "eps", eps))), w), b)


def rmsnorm_llama(g, x, w, eps=1e-6):
    return g.mul(w, g.mul(x, g.rsqrt(g.add(g.reduce_mean(g.pow(x, scalar(g, "two", 2.0)), axes=(-1,), keepdims=True),
                                               scalar(g, "eps", eps)))))


def gelu_erf_div(g, x):
    """0.5 * x * (1 + erf(x / sqrt(2)))."""
    erf = g.erf(g.div(x, scalar(g, "root2", math.sqrt(2))))
    return g.mul(g.mul(scalar(g, "half", 0.5), x), g.add(scalar(g, "one", 1.0), erf))


def gelu_erf_mul(g, x):
    """((erf(x * 0.70710677) + 1) * x) * 0.5, as another exporter orders it."""
    return g.mul(g.mul(g.add(g.erf(g.mul(x, scalar(g, "c", 0.70710677))), scalar(g, "one", 1.0)), x), scalar(g, "half", 0.5))


def gelu_tanh(g, x):
    cubed = g.mul(scalar(g, "k", 0.044715), g.pow(x, scalar(g, "three", 3.0)))
    inner = g.mul(scalar(g, "c", math.sqrt(2 / math.pi)), g.add(x, cubed))
    return g.mul(g.mul(x, scalar(g, "half", 0.5)), g.add(g.tanh(inner), scalar(g, "one", 1.0)))


def softmax_div(g, x):
    e = g.exp(g.sub(x, g.reduce_max(x, axes=(-1,), keepdims=True)))
    return g.div(e, g.reduce_sum(e, axes=(-1,), keepdims=True))


def softmax_reciprocal(g, x):
    e = g.exp(g.add(x, g.neg(g.reduce_max(x, axes=(-1,), keepdims=True))))
    return g.mul(g.reciprocal(g.reduce_sum(e, axes=(-1,), keepdims=True)), e)


def softmax_unstable(g, x):
    """Not the softmax formula: no maximum subtracted (it overflows where softmax does not)."""
    e = g.exp(x)
    return g.div(e, g.reduce_sum(e, axes=(-1,), keepdims=True))


def silu_of(g, x):
    return g.mul(x, g.sigmoid(x))


def groupnorm_of(g, x):
    """A group norm: a layernorm's formula over rows regrouped by a reshape, no layernorm of x itself."""
    rows = g.reshape(x, shape=(3, 2, 8))
    d = g.sub(rows, g.reduce_mean(rows, axes=(-1,), keepdims=True))
    var = g.reduce_mean(g.mul(d, d), axes=(-1,), keepdims=True)
    return g.reshape(g.mul(d, g.rsqrt(g.add(var, scalar(g, "eps", 1e-5)))), shape=(3, 4, 2, 2))


CASES = [  # (builder, input shapes, the fused op it is, or None)
    (layernorm_pow_div, [(2, 5, 16), (16,), (16,)], "layernorm"),
    (layernorm_rsqrt_mul, [(2, 5, 16), (16,), (16,)], "layernorm"),
    (layernorm_eps_outside, [(2, 5, 16), (16,), (16,)], None),
    (rmsnorm_llama, [(3, 16), (16,)], "rmsnorm"),
    (gelu_erf_div, [(3, 16)], "gelu"),
    (gelu_erf_mul, [(3, 16)], "gelu"),
    (gelu_tanh, [(3, 16)], "gelu"),
    (softmax_div, [(2, 4, 9)], "softmax"),
    (softmax_reciprocal, [(2, 4, 9)], "softmax"),
    (softmax_unstable, [(2, 4, 9)], None),
    (silu_of, [(3, 16)], "silu"),
]


def built(builder, shapes, weights_as_constants=True):
    g = GraphBuilder()
    x = g.input("x", shapes[0], "f32")
    rest = [g.const(f"w{i}", RNG.standard_normal(s).astype(np.float32)) if weights_as_constants else g.input(f"w{i}", s, "f32")
            for i, s in enumerate(shapes[1:])]
    return g.output(builder(g, x, *rest))


def ops(graph) -> Counter:
    return Counter(n.op for n in graph.nodes)


@pytest.mark.parametrize("builder,shapes,fused", CASES, ids=[c[0].__name__ for c in CASES])
def test_primitive_graphs_become_the_fused_op_they_compute(builder, shapes, fused):
    graph = built(builder, shapes)
    plain = copy.deepcopy(graph)
    report = fuse(graph)
    x = {"x": RNG.standard_normal(shapes[0]).astype(np.float32) * 3}
    want = Plan(plain, CPU).run(x)[0]
    got = Plan(graph, CPU).run(x)[0]
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    live = ops(Plan(graph, CPU).graph)
    if fused is None:
        assert not report and live == ops(Plan(plain, CPU).graph)
    else:
        assert report[f"recognized {fused}"] == 1 and live == {fused: 1}, (report, live)


def test_a_norm_over_regrouped_rows_is_recognized_on_those_rows_not_on_x():
    graph = built(groupnorm_of, [(3, 4, 2, 2)])
    plain = copy.deepcopy(graph)
    report = fuse(graph)
    x = {"x": RNG.standard_normal((3, 4, 2, 2)).astype(np.float32)}
    np.testing.assert_allclose(Plan(graph, CPU).run(x)[0], Plan(plain, CPU).run(x)[0], rtol=1e-5, atol=1e-5)
    norm = next(n for n in graph.nodes if n.op == "layernorm")
    assert report["recognized layernorm"] == 1 and graph.tensors[norm.inputs[0]].shape == (3, 2, 8)


def attention(g, q, k, v, mask, style):
    """softmax(q k^T * scale + mask) v, as two exporters write it."""
    if style == "transpose-mul":
        scores = g.mul(g.matmul(q, g.transpose(k, dim0=-2, dim1=-1)), scalar(g, "scale", 0.25))
    else:                                        # keys permuted, scores divided by sqrt(d)
        scores = g.div(g.matmul(q, g.permute(k, perm=(0, 1, 3, 2))), scalar(g, "root_d", 4.0))
    probs = g.softmax(g.add(scores, mask)) if style == "transpose-mul" else softmax_div(g, g.add(mask, scores))
    return g.matmul(probs, v)


@pytest.mark.parametrize("style", ["transpose-mul", "permute-div"])
def test_attention_of_primitive_ops_becomes_sdpa(style):
    g = GraphBuilder()
    q, k, v = (g.input(n, (2, 3, 5, 16), "f32") for n in "qkv")
    mask = g.input("mask", (2, 1, 1, 5), "f32")
    graph = g.output(attention(g, q, k, v, mask, style))
    plain = copy.deepcopy(graph)
    report = fuse(graph)
    inputs = {n: RNG.standard_normal((2, 3, 5, 16)).astype(np.float32) for n in "qkv"}
    inputs["mask"] = np.where(RNG.random((2, 1, 1, 5)) < 0.3, -np.inf, 0).astype(np.float32)
    inputs["mask"][..., 0] = 0
    np.testing.assert_allclose(Plan(graph, CPU).run(inputs)[0], Plan(plain, CPU).run(inputs)[0], rtol=1e-5, atol=1e-5)
    node = next(n for n in Plan(graph, CPU).graph.nodes if n.op == "sdpa")
    assert report["recognized sdpa"] == 1 and node.attrs["scale"] == pytest.approx(0.25)


def test_keys_given_already_transposed_are_transposed_back_for_sdpa():
    g = GraphBuilder()
    q, v = g.input("q", (1, 2, 4, 8), "f32"), g.input("v", (1, 2, 4, 8), "f32")
    keys_t = g.input("kt", (1, 2, 8, 4), "f32")
    graph = g.output(g.matmul(g.softmax(g.mul(g.matmul(q, keys_t), scalar(g, "scale", 0.3))), v))
    plain = copy.deepcopy(graph)
    assert fuse(graph)["recognized sdpa"] == 1
    inputs = {name: RNG.standard_normal(shape).astype(np.float32)
              for name, shape in (("q", (1, 2, 4, 8)), ("v", (1, 2, 4, 8)), ("kt", (1, 2, 8, 4)))}
    np.testing.assert_allclose(Plan(graph, CPU).run(inputs)[0], Plan(plain, CPU).run(inputs)[0], rtol=1e-5, atol=1e-5)


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    from soma_runtime.tasks import Runtime
    from tests.fixtures.decoders import build_model
    directory = str(tmp_path_factory.mktemp("llama"))
    hf_model, tok = build_model("llama", directory)
    return directory, hf_model, tok, Runtime("cpu").load(directory, progress=False)


def test_a_plain_math_decoder_becomes_the_graph_the_fused_kernels_run(tiny_llama):
    """Per layer: q/k/v stacked with their norm in one product; keys rotated and stored with the values in
    one append; queries rotated by attention; the o and down products adding the residual; gate and up
    interleaved, normed and gated in one product. The head takes the final norm."""
    _, _, _, model = tiny_llama
    cfg, graph = model.engine.cfg, model.engine.stages[0].graph
    layers, nodes = cfg.num_layers, graph.nodes
    assert not {"rmsnorm", "rope", "add", "swiglu"} & {n.op for n in nodes}
    matmuls = [n for n in nodes if n.op == "matmul"]
    assert len(matmuls) == 4 * layers + 1
    qkv = [n for n in matmuls if graph.constants[n.inputs[1]].shape[0] == (cfg.num_heads + 2 * cfg.num_kv_heads) * cfg.head_dim]
    gated = [n for n in matmuls if n.attrs.get("epilogue") == "swiglu"]
    residual = [n for n in matmuls if n.inputs[3] is not None]
    assert len(qkv) == len(gated) == layers and len(residual) == 2 * layers
    assert all(n.inputs[4] is not None for n in qkv + gated) and matmuls[-1].inputs[4] is not None
    appends = [n for n in nodes if n.op == "kv_append"]
    attention = [n for n in nodes if n.op == "paged_attention"]
    assert len(appends) == len(attention) == layers
    assert all(None not in n.inputs for n in appends) and all(n.inputs[6] is not None for n in attention)


def test_the_fused_plan_computes_the_plain_one_and_verifies_against_its_atoms(tiny_llama, monkeypatch):
    """The fused graph's logits are the plain-math graph's (a model loaded with the pass turned off), and
    SOMA_VERIFY=1 (every jet beside its atoms) passes on the fused plan; both are transformers'."""
    import torch

    from soma_runtime.ir import program
    from soma_runtime.tasks import Runtime
    directory, hf_model, tok, model = tiny_llama
    ids = tok.encode("The quick brown fox jumps over the lazy dog.").ids
    fused = model.logits(ids)
    with monkeypatch.context() as off:
        off.setattr(program, "fuse", lambda graph, recognition, chains: Counter())
        plain = Runtime("cpu").load(directory, progress=False)
    assert Counter(n.op for n in plain.engine.stages[0].graph.nodes)["rope"] == 2 * plain.engine.cfg.num_layers
    monkeypatch.setenv("SOMA_VERIFY", "1")
    verified = Runtime("cpu").load(directory, progress=False).logits(ids)
    with torch.no_grad():
        want = hf_model(torch.tensor([ids])).logits[0].numpy()
    scale = np.abs(want).max()
    np.testing.assert_allclose(fused, plain.logits(ids), rtol=0, atol=1e-5 * scale)
    np.testing.assert_allclose(verified, fused, rtol=0, atol=1e-5 * scale)
    np.testing.assert_allclose(fused, want, rtol=0, atol=1e-4 * scale)
