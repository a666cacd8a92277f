"""Quantized ONNX ops (ai.onnx's integer and QLinear ops) and onnxruntime's contrib ops (com.microsoft),
each against onnxruntime on the same file: integers exactly, floats within rtol 1e-3; and what
onnxruntime.quantization writes for a small torch model."""
from __future__ import annotations

import os

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from soma_runtime.tasks import Runtime

ort = pytest.importorskip("onnxruntime")
rng = np.random.default_rng(53)
TYPES = {np.dtype(np.uint8): TensorProto.UINT8, np.dtype(np.int8): TensorProto.INT8,
         np.dtype(np.float32): TensorProto.FLOAT, np.dtype(np.int32): TensorProto.INT32, np.dtype(np.int64): TensorProto.INT64}


def graph_model(nodes, inputs: dict, weights: dict, outputs: list[str], opset=21, ms_opset=None) -> onnx.ModelProto:
    """A model of `nodes` over inputs (name -> example array) and initializers; outputs' types left to inference."""
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info(k, TYPES[v.dtype], list(v.shape))
                                           for k, v in inputs.items()],
                              [helper.make_value_info(o, onnx.TypeProto()) for o in outputs],
                              [numpy_helper.from_array(v, k) for k, v in weights.items()])
    imports = [helper.make_opsetid("", opset)] + ([helper.make_opsetid("com.microsoft", ms_opset)] if ms_opset else [])
    return helper.make_model(graph, opset_imports=imports, ir_version=10)


def both(model: onnx.ModelProto, inputs: dict, tmp_path, name="model.onnx") -> tuple[list, list]:
    """Our outputs and onnxruntime's, in the graph's output order."""
    path = os.path.join(tmp_path, name)
    onnx.save(model, path)
    ours = Runtime("cpu").load(path).run(inputs)
    theirs = ort.InferenceSession(path, providers=["CPUExecutionProvider"]).run(None, inputs)
    return [ours[o.name] for o in model.graph.output], theirs


def save_model(model: onnx.ModelProto, directory, name: str) -> str:
    path = os.path.join(directory, name)
    onnx.save(model, path)
    return path


def u8(*shape):
    return rng.integers(0, 256, shape).astype(np.uint8)


def i8(*shape):
    return rng.integers(-128, 128, shape).astype(np.int8)


@pytest.mark.parametrize("k", [16, 1024])
def test_matmul_integer_is_exact_over_long_inner_axes(tmp_path, k):
    a, b = u8(3, 5, k), i8(k, 7)
    node = helper.make_node("MatMulInteger", ["a", "b", "az", "bz"], ["y"])
    model = graph_model([node], {"a": a}, {"b": b, "az": np.array(131, np.uint8), "bz": np.array(-3, np.int8)}, ["y"])
    (ours,), (theirs,) = both(model, {"a": a}, tmp_path)
    assert ours.dtype == np.int32
    np.testing.assert_array_equal(ours, theirs)


def test_matmul_integer_of_two_activations_with_per_column_zero_points(tmp_path):
    a, b = u8(4, 600), u8(600, 3)
    node = helper.make_node("MatMulInteger", ["a", "b", "az", "bz"], ["y"])
    model = graph_model([node], {"a": a, "b": b}, {"az": np.array(7, np.uint8),
                                                   "bz": np.array([1, 128, 255], np.uint8)}, ["y"])
    (ours,), (theirs,) = both(model, {"a": a, "b": b}, tmp_path)
    np.testing.assert_array_equal(ours, theirs)


def test_dynamic_quantize_linear_matches_onnxruntime(tmp_path):
    x = (rng.standard_normal((4, 33)) * 3 + 1).astype(np.float32)
    node = helper.make_node("DynamicQuantizeLinear", ["x"], ["y", "scale", "zero"])
    (y, scale, zero), (ry, rscale, rzero) = both(graph_model([node], {"x": x}, {}, ["y", "scale", "zero"]), {"x": x}, tmp_path)
    np.testing.assert_array_equal(zero, rzero)
    np.testing.assert_allclose(scale, rscale, rtol=1e-6)
    assert np.abs(y.astype(int) - ry.astype(int)).max() <= 1 and (y == ry).mean() > 0.99      # ties of x / scale


@pytest.mark.parametrize("channels,group,kernel", [(3, 1, 3), (64, 1, 3), (8, 8, 3), (40, 2, 5)])
def test_conv_integer_is_exact(tmp_path, channels, group, kernel):
    x, w = u8(2, channels, 9, 8), i8(4 * group, channels // group, kernel, kernel)
    node = helper.make_node("ConvInteger", ["x", "w", "xz", "wz"], ["y"], group=group, pads=[1, 2, 0, 1],
                            strides=[1, 2])
    model = graph_model([node], {"x": x}, {"w": w, "xz": np.array(100, np.uint8), "wz": np.array(5, np.int8)}, ["y"])
    (ours,), (theirs,) = both(model, {"x": x}, tmp_path)
    np.testing.assert_array_equal(ours, theirs)


def test_qlinear_matmul_matches_onnxruntime(tmp_path):
    a, b = u8(2, 3, 300), u8(300, 6)
    node = helper.make_node("QLinearMatMul", ["a", "as", "az", "b", "bs", "bz", "ys", "yz"], ["y"])
    weights = {"as": np.array(0.02, np.float32), "az": np.array(120, np.uint8), "b": b,
               "bs": np.array(0.01, np.float32), "bz": np.array(130, np.uint8),
               "ys": np.array(0.5, np.float32), "yz": np.array(100, np.uint8)}
    (ours,), (theirs,) = both(graph_model([node], {"a": a}, weights, ["y"]), {"a": a}, tmp_path)
    np.testing.assert_array_equal(ours, theirs)


def test_qlinear_conv_with_per_channel_weights_and_bias_matches_onnxruntime(tmp_path):
    x, w = u8(1, 16, 7, 7), i8(5, 16, 3, 3)
    node = helper.make_node("QLinearConv", ["x", "xs", "xz", "w", "ws", "wz", "ys", "yz", "b"], ["y"], pads=[1, 1, 1, 1])
    weights = {"xs": np.array(0.03, np.float32), "xz": np.array(128, np.uint8), "w": w,
               "ws": rng.uniform(0.001, 0.01, 5).astype(np.float32), "wz": np.zeros(5, np.int8),
               "ys": np.array(0.2, np.float32), "yz": np.array(90, np.uint8),
               "b": rng.integers(-3000, 3000, 5).astype(np.int32)}
    (ours,), (theirs,) = both(graph_model([node], {"x": x}, weights, ["y"]), {"x": x}, tmp_path)
    np.testing.assert_array_equal(ours, theirs)


def small_cnn_onnx(path: str) -> None:
    """A conv, pool and linear layers model exported by torch (random weights, fixed seed)."""
    torch = pytest.importorskip("torch")
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Conv2d(3, 32, 3, padding=1), torch.nn.ReLU(), torch.nn.Conv2d(32, 48, 3, stride=2),
                              torch.nn.ReLU(), torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten(),
                              torch.nn.Linear(48, 300), torch.nn.ReLU(), torch.nn.Linear(300, 10)).eval()
    torch.onnx.export(net, (torch.randn(1, 3, 16, 16),), path, input_names=["x"], output_names=["y"],
                      dynamic_axes={"x": {0: "batch"}}, opset_version=17, dynamo=False)


def test_quantize_dynamic_output_of_a_torch_cnn_agrees_with_onnxruntime(tmp_path):
    quantization = pytest.importorskip("onnxruntime.quantization")
    source, quantized = str(tmp_path / "float.onnx"), str(tmp_path / "dynamic.onnx")
    small_cnn_onnx(source)
    quantization.quantize_dynamic(source, quantized, weight_type=quantization.QuantType.QUInt8)
    ops = {n.op_type for n in onnx.load(quantized).graph.node}
    assert {"ConvInteger", "MatMulInteger", "DynamicQuantizeLinear"} <= ops
    x = rng.standard_normal((2, 3, 16, 16)).astype(np.float32)
    ours = Runtime("cpu").load(quantized).run({"x": x})["y"]
    theirs = ort.InferenceSession(quantized, providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
    np.testing.assert_allclose(ours, theirs, rtol=1e-3, atol=1e-3 * np.abs(theirs).max())


def test_quantize_static_qdq_output_of_a_torch_cnn_agrees_with_onnxruntime(tmp_path):
    quantization = pytest.importorskip("onnxruntime.quantization")
    source, quantized = str(tmp_path / "float.onnx"), str(tmp_path / "qdq.onnx")
    small_cnn_onnx(source)

    class Calibration(quantization.CalibrationDataReader):
        def __init__(self):
            self.batches = iter([{"x": rng.standard_normal((1, 3, 16, 16)).astype(np.float32)} for _ in range(4)])

        def get_next(self):
            return next(self.batches, None)

    quantization.quantize_static(source, quantized, Calibration(), quant_format=quantization.QuantFormat.QDQ,
                                 per_channel=True)
    ops = {n.op_type for n in onnx.load(quantized).graph.node}
    assert {"QuantizeLinear", "DequantizeLinear"} <= ops
    x = rng.standard_normal((3, 3, 16, 16)).astype(np.float32)
    ours = Runtime("cpu").load(quantized).run({"x": x})["y"]
    theirs = ort.InferenceSession(quantized, providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
    np.testing.assert_allclose(ours, theirs, rtol=1e-3, atol=2e-2 * np.abs(theirs).max())


# --- com.microsoft ----------------------------------------------------------------------------

def f32(*shape):
    return rng.standard_normal(shape).astype(np.float32)


def contrib(op: str, inputs: dict, weights: dict, outputs=("y",), domain="com.microsoft", **attrs):
    names = list(inputs) + list(weights)
    node = helper.make_node(op, [n if n in inputs or n in weights else "" for n in attrs.pop("order", names)],
                            list(outputs), domain=domain, **attrs)
    return graph_model([node], inputs, weights, list(outputs), opset=17, ms_opset=1)


@pytest.mark.parametrize("op,extra", [("Gelu", {}), ("FastGelu", {}), ("FastGelu", {"bias": 7}), ("BiasGelu", {"bias": 7}),
                                      ("QuickGelu", {})])
def test_contrib_gelus_match_onnxruntime(tmp_path, op, extra):
    x = f32(2, 3, 7) * 3
    weights = {"bias": f32(7)} if extra else {}
    (ours,), (theirs,) = both(contrib(op, {"x": x}, weights), {"x": x}, tmp_path)
    np.testing.assert_allclose(ours, theirs, rtol=1e-3, atol=1e-5)


@pytest.mark.parametrize("with_bias", [False, True])
def test_skip_layer_normalization_and_its_sum_match_onnxruntime(tmp_path, with_bias):
    x, skip = f32(2, 5, 16), f32(2, 5, 16)
    weights = {"gamma": f32(16), "beta": f32(16)} | ({"bias": f32(16)} if with_bias else {})
    model = contrib("SkipLayerNormalization", {"x": x, "skip": skip}, weights, outputs=("y", "", "", "sum"),
                    order=["x", "skip", "gamma", "beta", "bias"], epsilon=1e-5)
    model.graph.output.pop(1)
    model.graph.output.pop(1)
    ours, theirs = both(model, {"x": x, "skip": skip}, tmp_path)
    for a, b in zip(ours, theirs):
        np.testing.assert_allclose(a, b, rtol=1e-3, atol=1e-5)


def test_simplified_layer_norms_match_onnxruntime(tmp_path):
    x, skip = f32(3, 4, 32), f32(3, 4, 32)
    model = contrib("SkipSimplifiedLayerNormalization", {"x": x, "skip": skip}, {"gamma": f32(32)}, epsilon=1e-6)
    (ours,), (theirs,) = both(model, {"x": x, "skip": skip}, tmp_path)
    np.testing.assert_allclose(ours, theirs, rtol=1e-3, atol=1e-5)
    model = contrib("SimplifiedLayerNormalization", {"x": x}, {"scale": f32(32)}, domain="", epsilon=1e-6)
    (ours,), (theirs,) = both(model, {"x": x}, tmp_path, "simplified.onnx")
    np.testing.assert_allclose(ours, theirs, rtol=1e-3, atol=1e-5)


def test_fused_conv_with_activation_and_sum_matches_onnxruntime(tmp_path):
    x, z = f32(1, 4, 8, 8), f32(1, 6, 8, 8)
    model = contrib("FusedConv", {"x": x, "z": z}, {"w": f32(6, 4, 3, 3), "b": f32(6)}, order=["x", "w", "b", "z"],
                    activation="LeakyRelu", activation_params=[0.2], pads=[1, 1, 1, 1])
    (ours,), (theirs,) = both(model, {"x": x, "z": z}, tmp_path)
    np.testing.assert_allclose(ours, theirs, rtol=1e-3, atol=1e-4)


@pytest.mark.parametrize("bits,block,zeros", [(4, 32, False), (4, 16, True), (4, 128, True), (8, 64, False), (8, 32, True),
                                             (4, 32, "float")])
def test_matmul_nbits_matches_onnxruntime(tmp_path, bits, block, zeros):
    k, n = 200, 24                                    # K not a multiple of the block: the last block padded
    blocks = -(-k // block)
    q = rng.integers(0, 1 << bits, (n, blocks, block)).astype(np.uint8)
    per_byte = 8 // bits
    packed = sum(q[..., i::per_byte] << (bits * i) for i in range(per_byte)).astype(np.uint8)
    weights = {"w": packed, "scales": rng.uniform(0.01, 0.1, n * blocks).astype(np.float32)}
    if zeros == "float":
        weights["zeros"] = rng.uniform(0, (1 << bits) - 1, n * blocks).astype(np.float32)
    elif zeros:
        z = rng.integers(0, 1 << bits, (n, blocks + (-blocks) % per_byte)).astype(np.uint8)
        weights["zeros"] = sum(z[:, i::per_byte] << (bits * i) for i in range(per_byte)).astype(np.uint8).reshape(-1)
    weights["bias"] = f32(n)
    a = f32(2, 3, k)
    model = contrib("MatMulNBits", {"a": a}, weights, order=["a", "w", "scales", "zeros", "", "bias"], K=k, N=n, bits=bits,
                    block_size=block)
    (ours,), (theirs,) = both(model, {"a": a}, tmp_path)
    np.testing.assert_allclose(ours, theirs, rtol=1e-3, atol=1e-3 * np.abs(theirs).max())


def test_an_unknown_contrib_op_names_node_op_domain_and_opset(tmp_path):
    x = f32(2, 3)
    path = os.path.join(tmp_path, "m.onnx")
    onnx.save(contrib("NoSuchFusedOp", {"x": x}, {}), path)
    from soma_runtime.errors import UnsupportedModelError
    named = r"node 'NoSuchFusedOp' \(NoSuchFusedOp, opset 1\).*com\.microsoft\.NoSuchFusedOp"
    with pytest.raises(UnsupportedModelError, match=named):
        Runtime("cpu").load(path).run({"x": x})


@pytest.mark.parametrize("mask_rank,unidirectional", [(0, 0), (1, 0), (2, 0), (3, 0), (2, 1)])
def test_attention_with_each_mask_form_matches_onnxruntime(tmp_path, mask_rank, unidirectional):
    b, s, hidden, heads = 2, 6, 16, 4
    x = f32(b, s, hidden)
    inputs = {"x": x}
    if mask_rank == 1:
        inputs["mask"] = np.array([6, 3], np.int32)
    elif mask_rank:
        inputs["mask"] = rng.integers(0, 2, (b, s) if mask_rank == 2 else (b, s, s)).astype(np.int32)
        inputs["mask"][..., 0] = 1
    sizes = [16, 16, 8]                                   # a narrower v than q and k
    model = contrib("Attention", inputs, {"w": f32(hidden, sum(sizes)), "bias": f32(sum(sizes))},
                    order=["x", "w", "bias", "mask"], num_heads=heads, qkv_hidden_sizes=sizes, unidirectional=unidirectional)
    (ours,), (theirs,) = both(model, inputs, tmp_path)
    np.testing.assert_allclose(ours, theirs, rtol=1e-3, atol=1e-5)


def tiny_bert_onnx(path: str) -> None:
    """A tiny random BERT (2 layers, hidden 32) exported by torch with dynamic batch and sequence axes."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.BertConfig(vocab_size=100, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                     intermediate_size=64, max_position_embeddings=64, attn_implementation="eager")
    bert = transformers.BertModel(config).eval()

    class Encoder(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.bert = bert

        def forward(self, ids, mask):
            return self.bert(input_ids=ids, attention_mask=mask).last_hidden_state

    axes = {0: "batch", 1: "sequence"}
    torch.onnx.export(Encoder(), (torch.randint(0, 100, (2, 9)), torch.ones(2, 9, dtype=torch.int64)), path,
                      input_names=["input_ids", "attention_mask"], output_names=["hidden"],
                      dynamic_axes={"input_ids": axes, "attention_mask": axes}, opset_version=17, dynamo=False)


@pytest.mark.parametrize("fused,quantized", [(True, False), (True, True), (False, True)])
def test_onnxruntime_transformers_optimizer_and_quantization_outputs_for_a_bert_agree_with_onnxruntime(tmp_path, fused,
                                                                                                     quantized):
    """The optimizer fuses a tiny random BERT into EmbedLayerNormalization, Attention (key lengths as its
    mask), BiasGelu and SkipLayerNormalization; quantize_dynamic makes those QEmbedLayerNormalization and
    QAttention (or, unfused, MatMulInteger). Two batch and sequence sizes, one row padded."""
    optimizer = pytest.importorskip("onnxruntime.transformers.optimizer")
    quantization = pytest.importorskip("onnxruntime.quantization")
    path = str(tmp_path / "bert.onnx")
    tiny_bert_onnx(path)
    if fused:
        optimizer.optimize_model(path, model_type="bert", num_heads=4, hidden_size=32, opt_level=0).save_model_to_file(
            str(tmp_path / "fused.onnx"))
        path = str(tmp_path / "fused.onnx")
    if quantized:
        quantization.quantize_dynamic(path, str(tmp_path / "dynamic.onnx"),
                                      extra_options={"DefaultTensorType": TensorProto.FLOAT})
        path = str(tmp_path / "dynamic.onnx")
    ops = {n.op_type for n in onnx.load(path).graph.node}
    wanted = {"SkipLayerNormalization", "BiasGelu"} if fused else set()
    wanted |= ({"QEmbedLayerNormalization", "QAttention"} if fused else {"MatMulInteger"}) if quantized else \
        {"EmbedLayerNormalization", "Attention"}
    assert wanted <= ops
    model = Runtime("cpu").load(path)
    session = ort.InferenceSession(path, providers=["CPUExecutionProvider"])
    for batch, length in ((2, 9), (3, 5)):
        mask = np.ones((batch, length), np.int64)
        mask[1, length - 2:] = 0
        feeds = {"input_ids": rng.integers(0, 100, (batch, length)).astype(np.int64), "attention_mask": mask}
        np.testing.assert_allclose(model.run(feeds)["hidden"], session.run(None, feeds)[0], rtol=1e-3, atol=1e-4)


@pytest.mark.parametrize("rank,interleaved,partial,offset", [(3, 0, False, False), (3, 1, True, False), (4, 0, True, True),
                                                             (4, 1, False, True)])
def test_rotary_embedding_matches_onnxruntime(tmp_path, rank, interleaved, partial, offset):
    b, s, heads, head = 2, 5, 3, 8
    width = 4 if partial else head
    x = f32(b, s, heads * head) if rank == 3 else f32(b, heads, s, head)
    positions = np.array([3], np.int64) if offset else rng.integers(0, 16, (b, s)).astype(np.int64)
    angles = np.arange(16)[:, None] * rng.uniform(0.1, 1, width // 2)[None]
    weights = {"cos": np.cos(angles).astype(np.float32), "sin": np.sin(angles).astype(np.float32)}
    attrs = {"num_heads": heads, "rotary_embedding_dim": width} if partial else {}
    model = contrib("RotaryEmbedding", {"x": x, "positions": positions}, weights, interleaved=interleaved, **attrs)
    (ours,), (theirs,) = both(model, {"x": x, "positions": positions}, tmp_path)
    np.testing.assert_allclose(ours, theirs, rtol=1e-3, atol=1e-5)


@pytest.mark.parametrize("mask_rank,cross", [(0, False), (1, True), (2, False), (2, True)])
def test_multi_head_attention_matches_onnxruntime(tmp_path, mask_rank, cross):
    b, s, length, hidden, heads = 2, 4, 6 if cross else 4, 16, 2
    inputs = {"q": f32(b, s, hidden), "k": f32(b, length, hidden), "v": f32(b, length, hidden)}
    if mask_rank == 1:
        inputs["mask"] = np.array([length, 2], np.int32)
    elif mask_rank == 2:
        inputs["mask"] = rng.integers(0, 2, (b, length)).astype(np.int32)
        inputs["mask"][:, 0] = 1
    model = contrib("MultiHeadAttention", inputs, {"bias": f32(3 * hidden)}, order=["q", "k", "v", "bias", "mask"],
                    num_heads=heads)
    (ours,), (theirs,) = both(model, inputs, tmp_path)
    np.testing.assert_allclose(ours, theirs, rtol=1e-3, atol=1e-5)


@pytest.mark.parametrize("past,rotary,packed", [(0, False, False), (0, True, True), (5, True, False), (5, False, True)])
def test_group_query_attention_and_its_present_match_onnxruntime(tmp_path, past, rotary, packed):
    b, s, heads, kv_heads, head = 2, 1 if past else 3, 4, 2, 16          # onnxruntime: a past takes one new token
    inputs = {}
    if packed:
        inputs["q"] = f32(b, s, (heads + 2 * kv_heads) * head)
    else:
        inputs |= {"q": f32(b, s, heads * head), "k": f32(b, s, kv_heads * head), "v": f32(b, s, kv_heads * head)}
    inputs |= {"past_k": f32(b, kv_heads, past, head), "past_v": f32(b, kv_heads, past, head),
               "seqlens": np.full(b, past + s - 1, np.int32), "total": np.array(past + s, np.int32)}
    angles = np.arange(32)[:, None] * rng.uniform(0.1, 1, head // 2)[None]
    weights = {"cos": np.cos(angles).astype(np.float32), "sin": np.sin(angles).astype(np.float32)} if rotary else {}
    model = contrib("GroupQueryAttention", inputs, weights, outputs=("y", "present_k", "present_v"),
                    order=["q", "k", "v", "past_k", "past_v", "seqlens", "total", "cos", "sin"], num_heads=heads,
                    kv_num_heads=kv_heads, do_rotary=int(rotary))
    ours, theirs = both(model, inputs, tmp_path)
    for a, r in zip(ours, theirs):
        np.testing.assert_allclose(a, r, rtol=1e-3, atol=1e-5)


def test_group_query_attention_over_a_right_padded_first_prompt_matches_onnxruntime(tmp_path):
    b, s, heads, kv_heads, head = 2, 4, 4, 2, 16
    inputs = {"q": f32(b, s, heads * head), "k": f32(b, s, kv_heads * head), "v": f32(b, s, kv_heads * head),
              "past_k": f32(b, kv_heads, 0, head), "past_v": f32(b, kv_heads, 0, head),
              "seqlens": np.array([3, 1], np.int32), "total": np.array(s, np.int32)}
    angles = np.arange(32)[:, None] * rng.uniform(0.1, 1, head // 2)[None]
    weights = {"cos": np.cos(angles).astype(np.float32), "sin": np.sin(angles).astype(np.float32)}
    model = contrib("GroupQueryAttention", inputs, weights, outputs=("y", "present_k", "present_v"),
                    order=["q", "k", "v", "past_k", "past_v", "seqlens", "total", "cos", "sin"], num_heads=heads,
                    kv_num_heads=kv_heads, do_rotary=1)
    ours, theirs = both(model, inputs, tmp_path)
    for a, r in zip(ours, theirs):
        np.testing.assert_allclose(a, r, rtol=1e-3, atol=1e-5)


def quantized_pair(x_zero=128, y_zero=100):
    return {"xs": np.array(0.05, np.float32), "xz": np.array(x_zero, np.uint8), "ys": np.array(0.03, np.float32),
            "yz": np.array(y_zero, np.uint8)}


@pytest.mark.parametrize("op", ["QLinearAdd", "QLinearMul"])
def test_qlinear_add_and_mul_match_onnxruntime(tmp_path, op):
    a, b = u8(2, 3, 5), u8(5)
    weights = {"as": np.array(0.02, np.float32), "az": np.array(120, np.uint8), "b": b, "bs": np.array(0.04, np.float32),
               "bz": np.array(10, np.uint8), "cs": np.array(0.05, np.float32), "cz": np.array(128, np.uint8)}
    (ours,), (theirs,) = both(contrib(op, {"a": a}, weights), {"a": a}, tmp_path)
    assert np.abs(ours.astype(int) - theirs.astype(int)).max() <= 1 and (ours == theirs).mean() > 0.95


@pytest.mark.parametrize("op", ["QLinearSigmoid", "QLinearLeakyRelu", "QLinearGlobalAveragePool"])
def test_qlinear_activations_and_pool_match_onnxruntime(tmp_path, op):
    x = u8(2, 4, 5, 6)
    (ours,), (theirs,) = both(contrib(op, {"x": x}, quantized_pair(), order=["x", "xs", "xz", "ys", "yz"]), {"x": x}, tmp_path)
    assert np.abs(ours.astype(int) - theirs.astype(int)).max() <= 1 and (ours == theirs).mean() > 0.95


def test_qlinear_concat_matches_onnxruntime(tmp_path):
    a, b = u8(2, 3), u8(2, 4)
    weights = {"ys": np.array(0.05, np.float32), "yz": np.array(128, np.uint8), "as": np.array(0.02, np.float32),
               "az": np.array(120, np.uint8), "bs": np.array(0.07, np.float32), "bz": np.array(3, np.uint8)}
    model = contrib("QLinearConcat", {"a": a, "b": b}, weights, order=["ys", "yz", "a", "as", "az", "b", "bs", "bz"], axis=1)
    (ours,), (theirs,) = both(model, {"a": a, "b": b}, tmp_path)
    assert np.abs(ours.astype(int) - theirs.astype(int)).max() <= 1 and (ours == theirs).mean() > 0.95


@pytest.mark.parametrize("quantized_out", [False, True])
def test_qgemm_matches_onnxruntime(tmp_path, quantized_out):
    a, b = u8(3, 300), i8(7, 300)
    weights = {"as": np.array(0.02, np.float32), "az": np.array(120, np.uint8), "b": b,
               "bs": rng.uniform(0.001, 0.01, 7).astype(np.float32), "bz": np.zeros(7, np.int8),
               "c": rng.integers(-5000, 5000, 7).astype(np.int32)}
    if quantized_out:
        weights |= {"ys": np.array(0.3, np.float32), "yz": np.array(100, np.uint8)}
    model = contrib("QGemm", {"a": a}, weights, order=["a", "as", "az", "b", "bs", "bz", "c", "ys", "yz"], transB=1, alpha=0.5)
    (ours,), (theirs,) = both(model, {"a": a}, tmp_path)
    if quantized_out:
        assert np.abs(ours.astype(int) - theirs.astype(int)).max() <= 1 and (ours == theirs).mean() > 0.95
    else:
        np.testing.assert_allclose(ours, theirs, rtol=1e-5, atol=1e-6)


def test_quantize_static_qoperator_output_of_a_torch_cnn_agrees_with_onnxruntime(tmp_path):
    quantization = pytest.importorskip("onnxruntime.quantization")
    source, quantized = str(tmp_path / "float.onnx"), str(tmp_path / "qop.onnx")
    small_cnn_onnx(source)

    class Calibration(quantization.CalibrationDataReader):
        def __init__(self):
            self.batches = iter([{"x": rng.standard_normal((1, 3, 16, 16)).astype(np.float32)} for _ in range(4)])

        def get_next(self):
            return next(self.batches, None)

    quantization.quantize_static(source, quantized, Calibration(), quant_format=quantization.QuantFormat.QOperator)
    ops = {n.op_type for n in onnx.load(quantized).graph.node}
    assert {"QLinearConv", "QGemm", "QLinearGlobalAveragePool"} <= ops
    x = rng.standard_normal((2, 3, 16, 16)).astype(np.float32)
    ours = Runtime("cpu").load(quantized).run({"x": x})["y"]
    theirs = ort.InferenceSession(quantized, providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
    np.testing.assert_allclose(ours, theirs, rtol=1e-3, atol=2e-2 * np.abs(theirs).max())


def test_matmul_integer_to_float_and_dynamic_quantize_matmul_match_onnxruntime(tmp_path):
    a, q = f32(3, 4, 300), u8(3, 4, 300)
    weights = {"b": i8(300, 6), "bs": rng.uniform(0.001, 0.01, 6).astype(np.float32), "bz": np.zeros(6, np.int8),
               "bias": f32(6)}
    model = contrib("DynamicQuantizeMatMul", {"a": a}, weights, order=["a", "b", "bs", "bz", "bias"])
    (ours,), (theirs,) = both(model, {"a": a}, tmp_path)
    np.testing.assert_allclose(ours, theirs, rtol=1e-3, atol=1e-3 * np.abs(theirs).max())
    weights |= {"as": np.array(0.02, np.float32), "az": np.array(120, np.uint8)}
    model = contrib("MatMulIntegerToFloat", {"q": q}, weights, order=["q", "b", "as", "bs", "az", "bz", "bias"])
    (ours,), (theirs,) = both(model, {"q": q}, tmp_path, "to_float.onnx")
    np.testing.assert_allclose(ours, theirs, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("quantized", [False, True])
def test_models_onnxruntime_optimized_and_saved_agree_with_onnxruntime(tmp_path, quantized):
    """What an onnxruntime session writes as its optimized model: FusedConv and FusedGemm for the float CNN,
    DynamicQuantizeMatMul for its dynamically quantized variant."""
    quantization = pytest.importorskip("onnxruntime.quantization")
    source, optimized = str(tmp_path / "float.onnx"), str(tmp_path / "optimized.onnx")
    small_cnn_onnx(source)
    if quantized:
        quantization.quantize_dynamic(source, str(tmp_path / "dynamic.onnx"))
        source = str(tmp_path / "dynamic.onnx")
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED
    options.optimized_model_filepath = optimized
    ort.InferenceSession(source, options, providers=["CPUExecutionProvider"])
    ops = {n.op_type for n in onnx.load(optimized).graph.node}
    assert ({"DynamicQuantizeMatMul"} if quantized else {"FusedConv", "FusedGemm"}) <= ops
    x = rng.standard_normal((2, 3, 16, 16)).astype(np.float32)
    ours = Runtime("cpu").load(optimized).run({"x": x})["y"]
    theirs = ort.InferenceSession(optimized, providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
    np.testing.assert_allclose(ours, theirs, rtol=1e-3, atol=1e-3 * np.abs(theirs).max())


@pytest.mark.parametrize("axis,block", [(None, 0), (1, 0), (0, 4), (1, 3)])
def test_quantize_and_dequantize_linear_per_tensor_axis_and_block_match_onnxruntime(tmp_path, axis, block):
    x = (f32(6, 9) * 4).astype(np.float32)
    if axis is None:
        scale, zero = np.array(0.05, np.float32), np.array(7, np.int8)
    else:
        shape = [6, 9]
        shape[axis] = -(-shape[axis] // block) if block else shape[axis]
        shape = shape if block else [shape[axis]]
        scale = rng.uniform(0.02, 0.1, shape).astype(np.float32)
        zero = rng.integers(-5, 5, shape).astype(np.int8)
    attrs = {} if axis is None else {"axis": axis} | ({"block_size": block} if block else {})
    nodes = [helper.make_node("QuantizeLinear", ["x", "scale", "zero"], ["q"], **attrs),
             helper.make_node("DequantizeLinear", ["q", "scale", "zero"], ["y"], **attrs)]
    (q, y), (rq, ry) = both(graph_model(nodes, {"x": x}, {"scale": scale, "zero": zero}, ["q", "y"]), {"x": x}, tmp_path)
    np.testing.assert_array_equal(q, rq)
    np.testing.assert_allclose(y, ry, rtol=1e-6)


def test_gemm_fast_gelu_and_bias_add_match_onnxruntime(tmp_path):
    """onnxruntime runs these two only on GPUs: GemmFastGelu is compared with the MatMul and FastGelu it fuses."""
    x, skip = f32(2, 3, 16), f32(2, 3, 16)
    weights = {"w": f32(16, 24), "bias": f32(24)}
    ours = Runtime("cpu").load(save_model(contrib("GemmFastGelu", {"x": x}, weights), tmp_path, "fused.onnx")).run({"x": x})
    nodes = [helper.make_node("MatMul", ["x", "w"], ["xw"]),
             helper.make_node("FastGelu", ["xw", "bias"], ["y"], domain="com.microsoft")]
    (theirs,) = ort.InferenceSession(save_model(graph_model(nodes, {"x": x}, weights, ["y"], opset=17, ms_opset=1), tmp_path,
                                                "unfused.onnx"), providers=["CPUExecutionProvider"]).run(None, {"x": x})
    np.testing.assert_allclose(ours["y"], theirs, rtol=1e-3, atol=1e-5)
    bias = f32(16)                                    # BiasAdd too: the sum it fuses, in numpy
    model = contrib("BiasAdd", {"x": x, "skip": skip}, {"bias": bias}, order=["x", "bias", "skip"])
    ours = Runtime("cpu").load(save_model(model, tmp_path, "bias_add.onnx")).run({"x": x, "skip": skip})["y"]
    np.testing.assert_allclose(ours, x + bias + skip, rtol=1e-6)


def test_com_microsoft_quantize_and_dequantize_linear_match_onnxruntime(tmp_path):
    x = f32(4, 6) * 3
    weights = {"scale": rng.uniform(0.01, 0.1, 6).astype(np.float32), "zero": rng.integers(0, 9, 6).astype(np.uint8)}
    nodes = [helper.make_node("QuantizeLinear", ["x", "scale", "zero"], ["q"], domain="com.microsoft", axis=1),
             helper.make_node("DequantizeLinear", ["q", "scale", "zero"], ["y"], domain="com.microsoft", axis=1)]
    model = graph_model(nodes, {"x": x}, weights, ["q", "y"], opset=17, ms_opset=1)
    (q, y), (rq, ry) = both(model, {"x": x}, tmp_path)
    np.testing.assert_array_equal(q, rq)
    np.testing.assert_allclose(y, ry, rtol=1e-6)
