"""Convolution networks as exporters write them (issue 53, item 4): transformers' ResNet, MobileNetV2, ViT,
CLIP vision, ConvNeXt, EfficientNet and whisper encoder, and a YOLO-style block, exported by torch's two
exporters (TorchScript with dynamic batch and image axes; dynamo, opset 18, with a dynamic batch), each at two
sizes against onnxruntime and torch. The fuse pass folds each block's residual, activation (relu; relu6
written as a clip or as maximum/minimum; silu written as x * sigmoid(x)) and symmetric zero pad into its
convolution, and leaves alone what is not that formula."""
from __future__ import annotations

import warnings
from collections import Counter

import numpy as np
import pytest

from soma_runtime.backends import get
from soma_runtime.engine.graph import graph_runner
from soma_runtime.ir.passes import fuse
from soma_runtime.loaders.onnx import load_onnx

torch = pytest.importorskip("torch")
ort = pytest.importorskip("onnxruntime")
transformers = pytest.importorskip("transformers")
nn, F = torch.nn, torch.nn.functional


def randomized(module: nn.Module) -> nn.Module:
    """Weights and batch-norm statistics drawn at random, so every layer shapes the output (a fresh
    MobileNetV2's output is ~1e-19: agreement on it would prove nothing)."""
    torch.manual_seed(0)
    for m in module.modules():
        if isinstance(m, nn.BatchNorm2d):
            m.weight.data.uniform_(0.5, 1.5)
            m.bias.data.normal_(0, 0.2)
            m.running_mean.normal_(0, 0.2)
            m.running_var.uniform_(0.5, 1.5)
        elif isinstance(m, nn.Conv2d):
            m.weight.data.normal_(0, (2 / m.weight[0].numel()) ** 0.5)
    return module.eval()


class Features(nn.Module):
    """A transformers vision backbone's last hidden state (the head's input)."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, x):
        return self.model(x).last_hidden_state


TRACED = (32, 40)          # the image size the exporter traces at


EXPORTERS = ("torchscript", "dynamo")


def exported(tmp_path, module: nn.Module, size=TRACED, exporter: str = "torchscript") -> str:
    path = str(tmp_path / f"{exporter}.onnx")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if exporter == "dynamo":          # traced at a batch of 2: dynamo specializes a dimension of 1
            torch.onnx.export(module, (torch.randn(2, 3, *size),), path, input_names=["x"], output_names=["y"],
                              dynamic_shapes={"x": {0: torch.export.Dim("batch", min=1, max=64)}}, dynamo=True)
        else:
            torch.onnx.export(module, (torch.randn(1, 3, *size),), path, input_names=["x"], output_names=["y"],
                              dynamic_axes={"x": {0: "batch", 2: "height", 3: "width"}, "y": {0: "batch"}},
                              opset_version=17, dynamo=False)
    return path


def fusions_of(path: str) -> Counter:
    return fuse(load_onnx(path).graph)


def agrees(path: str, module: nn.Module, sizes, traced_only=False) -> None:
    """Ours equal to onnxruntime at each (batch, height, width), and to torch there too (or, for a model whose
    pads the exporter traced as constants, at the traced size only)."""
    ours = graph_runner(load_onnx(path).graph, get("cpu"))
    session = ort.InferenceSession(path, providers=["CPUExecutionProvider"])
    rng = np.random.default_rng(1)
    for b, h, w in sizes:
        x = rng.standard_normal((b, 3, h, w)).astype(np.float32)
        got, want = ours.run({"x": x})["y"], session.run(None, {"x": x})[0]
        scale = np.abs(want).max()
        assert scale > 1e-3 and got.shape == want.shape
        np.testing.assert_allclose(got, want, rtol=0, atol=1e-4 * scale)
        if not traced_only or (h, w) == TRACED:
            with torch.no_grad():
                np.testing.assert_allclose(got, module(torch.from_numpy(x)).numpy(), rtol=0, atol=1e-4 * scale)


@pytest.mark.parametrize("exporter", EXPORTERS)
def test_a_resnet_runs_each_block_as_convolutions_with_their_residual_and_relu_folded_in(tmp_path, exporter):
    config = transformers.ResNetConfig(layer_type="basic", depths=[1, 1], hidden_sizes=[8, 16], embedding_size=8)
    model = randomized(Features(transformers.ResNetModel(config)))
    path = exported(tmp_path, model, exporter=exporter)
    fused = fusions_of(path)
    assert fused["conv2d->residual"] == 2 and fused["conv2d+relu"] == 5, fused
    agrees(path, model, [(1, 32, 40), (2, 45, 29)] if exporter == "torchscript" else [(1, 32, 40), (3, 32, 40)])


def test_a_mobilenet_v2_folds_relu6_and_its_symmetric_pads_and_keeps_the_asymmetric_ones(tmp_path):
    config = transformers.MobileNetV2Config(depth_multiplier=0.35, num_channels=3, image_size=64)
    model = randomized(Features(transformers.MobileNetV2Model(config)))
    path = exported(tmp_path, model)
    fused = fusions_of(path)
    graph = load_onnx(path).graph
    fuse(graph)
    left = Counter(n.op for n in graph.nodes)
    assert fused["conv2d+relu6"] == 35 and fused["pad->conv2d"] > 0 and fused["conv2d->residual"] == 10, fused
    assert left["pad"] > 0 and not left["minimum"] and not left["maximum"], left      # TF-style stride-2 pads: one side
    agrees(path, model, [(1, 32, 40), (2, 32, 40), (2, 48, 80)], traced_only=True)     # its pads are traced constants


class YoloBlock(nn.Module):
    """Conv-BN-SiLU as YOLO writes it (x * sigmoid(x)), a bottleneck whose shortcut joins after the activation
    (not a residual the conv can take), a grouped conv, a clip to other bounds and a conv read twice."""

    def __init__(self):
        super().__init__()
        self.stem = nn.Conv2d(3, 8, 3, 2, 1)
        self.a = nn.Conv2d(8, 8, 3, 1, 1)
        self.b = nn.Conv2d(8, 8, 1)
        self.grouped = nn.Conv2d(8, 16, 3, 1, 1, groups=4)
        self.twice = nn.Conv2d(16, 8, 1)

    def forward(self, x):
        x = self.stem(x)
        x = x * torch.sigmoid(x)
        y = self.b(self.a(x))
        x = x + y * torch.sigmoid(y)                                  # shortcut after the activation
        x = F.hardtanh(self.grouped(x), 0.0, 5.0)                      # clip(0, 5): no epilogue
        t = self.twice(x)
        return F.max_pool2d(torch.relu(t) + t, 3, 2, 1)                # a conv whose output is read twice


@pytest.mark.parametrize("exporter", EXPORTERS)
def test_a_yolo_style_block_folds_silu_but_not_what_differs_from_the_epilogue_formula(tmp_path, exporter):
    model = randomized(YoloBlock())
    path = exported(tmp_path, model, exporter=exporter)
    fused = fusions_of(path)
    assert fused["recognized silu"] == 2 and fused["conv2d+silu"] == 2 and not fused["conv2d->residual"], fused
    assert not fused["conv2d+relu6"] and not fused["conv2d+relu"], fused
    agrees(path, model, [(1, 32, 40), (3, 21, 17)] if exporter == "torchscript" else [(1, 32, 40), (3, 32, 40)])


def tiny(name: str):
    """A transformers vision model of a few small layers, and the size its exporter traces at."""
    if name == "vit":
        return transformers.ViTModel(transformers.ViTConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                                            intermediate_size=64, image_size=32, patch_size=8)), (32, 32)
    if name == "clip_vision":
        return transformers.CLIPVisionModel(transformers.CLIPVisionConfig(
            hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64, image_size=32,
            patch_size=8)), (32, 32)
    if name == "convnext":
        return transformers.ConvNextModel(transformers.ConvNextConfig(hidden_sizes=[8, 16], depths=[1, 1],
                                                                      num_stages=2)), TRACED
    return transformers.EfficientNetModel(transformers.EfficientNetConfig(
        width_coefficient=0.25, depth_coefficient=0.25, image_size=32, hidden_dim=320)), TRACED


@pytest.mark.parametrize("name,exporter", [(n, "torchscript") for n in ("vit", "clip_vision", "convnext", "efficientnet")]
                         + [("vit", "dynamo"), ("efficientnet", "dynamo")])
def test_transformers_vision_backbones_exported_with_a_dynamic_batch_agree_with_onnxruntime_and_torch(tmp_path, name,
                                                                                                      exporter):
    """Patch embeddings (a convolution strided by its kernel), attention, layernorm and gelu; ConvNeXt's 7x7
    depthwise blocks and channels-last norms; EfficientNet's 5x5 depthwise, silu and squeeze-excitation."""
    model, size = tiny(name)
    model = randomized(Features(model))
    path = exported(tmp_path, model, size, exporter)
    agrees(path, model, [(1, *size), (3, *size)] + ([(2, 45, 29)] if size == TRACED and name == "convnext" else []))


def test_a_whisper_encoder_exported_with_a_dynamic_batch_agrees_with_onnxruntime_and_torch(tmp_path):
    config = transformers.WhisperConfig(d_model=32, encoder_layers=2, encoder_attention_heads=4, encoder_ffn_dim=64,
                                        decoder_layers=1, decoder_attention_heads=4, decoder_ffn_dim=64,
                                        num_mel_bins=16, max_source_positions=40)
    model = randomized(transformers.WhisperModel(config).get_encoder())
    features = torch.randn(1, 16, 80)
    path = str(tmp_path / "encoder.onnx")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(Features(model), (features,), path, input_names=["x"], output_names=["y"],
                          dynamic_axes={"x": {0: "batch"}, "y": {0: "batch"}}, opset_version=17, dynamo=False)
    ours = graph_runner(load_onnx(path).graph, get("cpu"))
    session = ort.InferenceSession(path, providers=["CPUExecutionProvider"])
    for batch in (1, 3):
        x = np.random.default_rng(batch).standard_normal((batch, 16, 80)).astype(np.float32)
        got, want = ours.run({"x": x})["y"], session.run(None, {"x": x})[0]
        scale = np.abs(want).max()
        np.testing.assert_allclose(got, want, rtol=0, atol=1e-4 * scale)
        with torch.no_grad():
            np.testing.assert_allclose(got, model(torch.from_numpy(x)).last_hidden_state.numpy(), rtol=0, atol=1e-4 * scale)
