"""What a loader gives: a model's config, weights, tokenizer, defaults and the task it runs (and, for an object
detector, what its file says of its head: Detector)."""
from __future__ import annotations

from dataclasses import dataclass, field

from soma_runtime.architectures.config import DecoderConfig
from soma_runtime.architectures.encoder import EncoderConfig
from soma_runtime.architectures.pooling import Pooling
from soma_runtime.architectures.vit import VitConfig
from soma_runtime.architectures.weights import Weights
from soma_runtime.architectures.whisper import WhisperConfig
from soma_runtime.image.preprocess import ImageProcessor
from soma_runtime.ir.graph import Graph
from soma_runtime.text.tokenizer import Tokenizer

TASKS = ("generate", "encode", "graph", "transcribe", "speak", "detect", "encode_image")


@dataclass(frozen=True)
class Detector:
    """An object detector's graph as its file describes it: `labels` by class id, the graph's image `input` and its
    detections `output`, the input `size` (height, width) it was exported at, its largest `stride`, the `batch` it
    was exported for, and whether the output is `suppressed` already ([B, max_det, 6] rows of x1, y1, x2, y2, score,
    class: NMS in the graph or an end-to-end head) or the anchor-free head's [B, 4 + classes, anchors]."""
    labels: dict[int, str]
    input: str
    output: str
    size: tuple[int, int]
    stride: int
    batch: int
    suppressed: bool
    head: str = "Detect"


@dataclass
class LoadedModel:
    path: str
    format: str                      # gguf | hf | soma | ctranslate2 | onnx | piper | graph
    config: DecoderConfig | EncoderConfig | WhisperConfig | VitConfig | None
    weights: Weights | None
    tokenizer: Tokenizer | None
    sampling: dict = field(default_factory=dict)    # the model's own generation defaults
    metadata: dict = field(default_factory=dict)
    pooling: Pooling | None = None                   # encoders: how token states become one embedding
    max_tokens: int | None = None                    # encoders: the longest input the model was trained on
    graph: Graph | None = None                       # a bare graph: its named inputs and outputs are the model
    detector: Detector | None = None                 # a detector's graph: what its file says of its head
    processor: ImageProcessor | None = None          # image models: their preprocessing (preprocessor_config.json)

    @property
    def task(self) -> str:
        """What the model is run for: `generate` text, `encode` texts (embed, classify), `transcribe` speech,
        `speak` text (a voice), `detect` objects in images, `encode_image` (embed, classify images), or run a bare
        `graph`."""
        if self.format == "piper":
            return "speak"
        if self.detector is not None:
            return "detect"
        if self.graph is not None:
            return "graph"
        if isinstance(self.config, WhisperConfig):
            return "transcribe"
        if isinstance(self.config, VitConfig):
            return "encode_image"
        return "encode" if self.pooling is not None else "generate"

    @classmethod
    def of_graph(cls, graph: Graph, name: str = "graph") -> LoadedModel:
        """A graph built in code (or imported), as a model of the `graph` task."""
        return cls(name, "graph", None, None, None, graph=graph)
