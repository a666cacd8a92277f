"""What a loader gives: a model's config, weights, tokenizer, defaults and the task it runs."""
from __future__ import annotations

from dataclasses import dataclass, field

from soma_runtime.architectures.config import DecoderConfig
from soma_runtime.architectures.encoder import EncoderConfig
from soma_runtime.architectures.pooling import Pooling
from soma_runtime.architectures.weights import Weights
from soma_runtime.architectures.whisper import WhisperConfig
from soma_runtime.ir.graph import Graph
from soma_runtime.text.tokenizer import Tokenizer

TASKS = ("generate", "encode", "graph", "transcribe", "speak")


@dataclass
class LoadedModel:
    path: str
    format: str                      # gguf | hf | soma | ctranslate2 | onnx | piper | graph
    config: DecoderConfig | EncoderConfig | WhisperConfig | None
    weights: Weights | None
    tokenizer: Tokenizer | None
    sampling: dict = field(default_factory=dict)    # the model's own generation defaults
    metadata: dict = field(default_factory=dict)
    pooling: Pooling | None = None                   # encoders: how token states become one embedding
    max_tokens: int | None = None                    # encoders: the longest input the model was trained on
    graph: Graph | None = None                       # a bare graph: its named inputs and outputs are the model

    @property
    def task(self) -> str:
        """What the model is run for: `generate` text, `encode` texts (embed, classify), `transcribe` speech,
        `speak` text (a voice), or run a bare `graph`."""
        if self.format == "piper":
            return "speak"
        if self.graph is not None:
            return "graph"
        if isinstance(self.config, WhisperConfig):
            return "transcribe"
        return "encode" if self.pooling is not None else "generate"

    @classmethod
    def of_graph(cls, graph: Graph, name: str = "graph") -> LoadedModel:
        """A graph built in code (or imported), as a model of the `graph` task."""
        return cls(name, "graph", None, None, None, graph=graph)
