"""The contract between a decoder template and the engine that runs it, declared once: the cache the
model keeps between steps and the layout of its pages in a step (kv_index), and the graph's inputs and
outputs by role. The template declares its inputs here (`DecoderIO.declare`), the engine feeds a step
through it (`DecoderIO.feed`): no graph input is named anywhere else. Knows graphs, nothing of kernels
or how a batch is scheduled.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass, field

from soma_runtime.ir.builder import GraphBuilder, Value
from soma_runtime.quant import kv


def kv_index(layer: int, which: int) -> int:
    """Where a layer's keys (which=0) or values (1) sit in a flat list of KV pages, the layout every such list
    has (DecoderStep.pages and copies, DecoderOutputs', the cross pages): k, v per layer, in layer order.
    `layer` counts from the list's first layer."""
    return 2 * layer + which


def kv_pages(pages: list, layer: int) -> tuple:
    """A layer's (keys, values) in a flat list of KV pages (kv_index)."""
    return pages[kv_index(layer, 0)], pages[kv_index(layer, 1)]


def kv_count(layers: int) -> int:
    """The length of a flat list of KV pages of `layers` layers (kv_index)."""
    return kv_index(layers, 0)


def kv_flat(keys: list, values: list) -> list:
    """A flat list of KV pages (kv_index) of each layer's keys and values."""
    return [p for pair in zip(keys, values) for p in pair]


@dataclass(frozen=True)
class PagedKV:
    """Self-attention keys and values in pages [P, block, kv_heads, head_dim], a pair a layer, kept across
    steps (engine/kv.py holds them): the cache of a decoder. `windows` gives each layer's sliding window
    (0: the layer sees its whole context); `dtype` is a kv_dtype spec (quant/kv.py): a float type, or
    codecs whose pages hold each head's vector as bytes [P, block, kv_heads, row_bytes]. `centers`: each
    layer's mean key [kv_heads, head_dim] (engine/generate/calibration.py), which layers whose keys are coded
    rotated store their keys about (`key_center`)."""
    layers: int
    kv_heads: int
    head_dim: int
    windows: tuple[int, ...]
    dtype: str
    centers: tuple | None = field(default=None, compare=False)

    @property
    def window_sizes(self) -> list[int]:
        return sorted(set(self.windows))

    @property
    def horizon(self) -> int:
        """How far back any layer's attention reaches: the widest window where every layer has one (a
        sequence's older keys are never read again), else 0 (the whole context)."""
        return max(self.windows) if self.windows and min(self.windows) > 0 else 0

    @functools.cached_property
    def layout(self) -> kv.Layout:
        return kv.layout(self.dtype, self.layers)

    def codec(self, layer: int, which: int) -> str:
        """Layer's key (which=0) or value (1) codec, "none" for a float cache."""
        kind = self.layout.kinds[layer][which]
        return kind if kind in kv.CODECS else "none"

    @property
    def wants_centers(self) -> bool:
        """Whether some layer codes its keys rotated (quant/kv.py), and so about a center."""
        return any(kv.rotated(k) for k, _ in self.layout.kinds)

    def key_center(self, layer: int):
        """The vector a layer's keys are stored less of, or None: its center where its keys are coded
        rotated. Every key a query sees shifts by it, so the query's scores shift by one constant, which
        softmax ignores, and the codes spend their levels on how keys differ rather than what they share."""
        return self.centers[layer] if self.centers is not None and kv.rotated(self.layout.kinds[layer][0]) else None

    def page_shape(self, layer: int, which: int, pages, block) -> tuple[tuple, str]:
        """The shape and dtype of a layer's key (which=0) or value (1) pages."""
        last, dtype = kv.page_meta(self.layout.kinds[layer][which], self.head_dim)
        return (pages, block, self.kv_heads, last), dtype

    def copies(self, layer: int) -> bool:
        """Whether a layer keeps float copies of its sinks' and window's keys and values (quant/kv.py)."""
        return self.layout.float_copies(layer)

    @property
    def keeps_copies(self) -> bool:
        return any(self.copies(i) for i in range(self.layers))

    def copy_page_shape(self, pages, block) -> tuple[tuple, str]:
        """The shape and dtype of a layer's copy pages: f16 vectors in the basis its codes are in."""
        return (pages, block, self.kv_heads, self.head_dim), "f16"

    def token_bytes(self, layers: range | None = None) -> int:
        """The cache's bytes for one token, over `layers` (default: all)."""
        kinds = self.layout.kinds
        layers = range(self.layers) if layers is None else layers
        return kv.bytes_per_token([kinds[i] for i in layers], self.kv_heads, self.head_dim)


@dataclass
class Attention:
    """What every layer's attention reads in one step, for its rows: their positions, the cache slots
    their keys and values go to, the slots of the context attention reads, and per window size each
    row's span [start, stop) of that context (its own sequence's, causal, within the window). Where the
    cache keeps float copies: the copy slot of each context slot a row may read there (or -1), and the
    copy slot each row's key and value go to."""
    positions: object
    slots: object
    ctx_slots: object
    spans: dict[int, object]
    copy_slots: object = None
    copy_written: object = None


@dataclass
class LoraStep:
    """What every adapted linear layer reads in one step: each row's adapter slot [S] (-1: none) and scale
    [S], and per module ("blk.3.attn_q") the slots' stacked factors a [LN, LR, in], b [LN, out, LR] and
    DoRA magnitudes [LN, out] (architectures/lora.py's, padded to the widest rank LR)."""
    index: object
    scale: object
    factors: dict[str, tuple] = field(default_factory=dict)


@dataclass
class DecoderStep:
    """One forward of a decoder: token ids, attention inputs, the rows whose logits are wanted with their
    sampling rows (temperature, top_k, top_p, min_p, u), and the cache's pages (k, v per layer) and copy
    pages (k, v per layer, None where a layer keeps none); for a graph of later layers, the hidden rows
    the layers before it gave instead of the ids."""
    ids: object
    attention: Attention
    logit_rows: object
    sampling: object
    pages: list = field(default_factory=list)
    hidden: object = None
    copies: list = field(default_factory=list)
    lora: LoraStep | None = None


@dataclass
class DecoderOutputs:
    """logits [R, vocab] of the wanted rows, each row's chosen token [R], and the updated pages (and copy
    pages, of the layers that keep them); a graph of earlier layers gives its hidden rows [S, width]
    instead of logits and choices."""
    logits: object
    choices: object
    pages: list
    hidden: object = None
    copies: list = field(default_factory=list)


class DecoderIO:
    """A decoder graph's inputs and outputs for a given cache. Dims: S rows, T context slots, R wanted
    rows, P pages of BLK slots. A graph may hold a run of the layers (a model split across devices): one
    not starting at layer 0 takes the hidden rows [S, width] the one before gives, one not ending at the
    last layer gives its hidden rows instead of logits and choices. `lora` gives the modules whose products
    take adapters, with their (in, out) sizes: the graph then reads a LoraStep."""

    def __init__(self, cache: PagedKV, layers: range | None = None, width: int = 0,
                 lora: dict[str, tuple[int, int]] | None = None):
        self.cache, self.layers, self.width = cache, range(cache.layers) if layers is None else layers, width
        self.lora = {m: sizes for m, sizes in (lora or {}).items() if int(m.split(".")[1]) in self.layers}

    @property
    def first(self) -> bool:
        return self.layers.start == 0

    @property
    def last(self) -> bool:
        return self.layers.stop == self.cache.layers

    @staticmethod
    def spans_name(window: int) -> str:
        return f"spans_w{window}" if window else "spans"

    def declare(self, g: GraphBuilder) -> DecoderStep:
        """The graph's inputs, as the step the template builds on."""
        c = self.cache
        attention = Attention(g.input("positions", ("S",), "i64"), g.input("slots", ("S",), "i64"),
                              g.input("ctx_slots", ("T",), "i64"),
                              {w: g.input(self.spans_name(w), ("S", 2), "i64") for w in c.window_sizes})
        if self.copy_layers:
            attention.copy_slots = g.input("copy_slots", ("T",), "i64")
            attention.copy_written = g.input("copy_written", ("S",), "i64")
        pages = [g.input(f"{name}_pages.{i}", *c.page_shape(i, j, "P", "BLK")) for i in self.layers
                 for j, name in enumerate("kv")]
        copies = [g.input(f"{name}_copies.{i}", *c.copy_page_shape("P", "BLK")) if i in self.copy_layers else None
                  for i in self.layers for name in "kv"]
        ids = g.input("ids", ("S",), "i64") if self.first else None
        hidden = None if self.first else g.input("hidden", ("S", self.width), "f32")
        rows, sampling = None, None
        if self.last:
            rows, sampling = g.input("logit_rows", ("R",), "i64"), g.input("sampling", ("R", 5), "f32")
        lora = None
        if self.lora:
            lora = LoraStep(g.input("lora_index", ("S",), "i64"), g.input("lora_scale", ("S",), "f32"),
                            {m: (g.input(f"lora_a.{m}", ("LN", "LR", k), "f32"), g.input(f"lora_b.{m}", ("LN", n, "LR"), "f32"),
                                 g.input(f"lora_m.{m}", ("LN", n), "f32")) for m, (k, n) in self.lora.items()})
        return DecoderStep(ids, attention, rows, sampling, pages, hidden, copies, lora)

    @functools.cached_property
    def copy_layers(self) -> list[int]:
        """This graph's layers that keep float copies."""
        return [i for i in self.layers if self.cache.copies(i)]

    def outputs(self, g: GraphBuilder, pages: list[Value], logits: Value = None, choices: Value = None, hidden: Value = None,
                copies: list[Value] = ()):
        return g.output(*((logits, choices) if self.last else (hidden,)), *pages, *copies)

    def feed(self, step: DecoderStep) -> dict:
        """The graph's inputs by name, for one step (`step.pages`: every layer's)."""
        a = step.attention
        named = {"positions": a.positions, "slots": a.slots, "ctx_slots": a.ctx_slots}
        named.update({"ids": step.ids} if self.first else {"hidden": step.hidden})
        if self.last:
            named.update(logit_rows=step.logit_rows, sampling=step.sampling)
        named.update({self.spans_name(w): span for w, span in a.spans.items()})
        named.update({f"{kv}_pages.{i}": step.pages[kv_index(i, j)] for i in self.layers for j, kv in enumerate("kv")})
        if self.copy_layers:
            named.update(copy_slots=a.copy_slots, copy_written=a.copy_written)
            named.update({f"{kv}_copies.{i}": step.copies[kv_index(i, j)] for i in self.copy_layers for j, kv in enumerate("kv")})
        if self.lora:
            named.update(lora_index=step.lora.index, lora_scale=step.lora.scale)
            for m in self.lora:
                named[f"lora_a.{m}"], named[f"lora_b.{m}"], named[f"lora_m.{m}"] = step.lora.factors[m]
        return named

    def shared(self) -> set[str]:
        """The inputs that are the same tensors every step (the pages and copy pages, updated in place)."""
        return {f"{kv}_{what}.{i}" for i in self.layers for kv in "kv" for what in ("pages", "copies")
                if what == "pages" or i in self.copy_layers}

    def read(self, outputs: list) -> DecoderOutputs:
        """The step's results; `pages`, this graph's layers' (k, v per layer), then `copies`, its copy layers'."""
        head, outputs = (outputs[:2], outputs[2:]) if self.last else (outputs[:1], outputs[1:])
        pages, copies = outputs[:kv_count(len(self.layers))], outputs[kv_count(len(self.layers)):]
        if self.last:
            return DecoderOutputs(*head, pages, copies=copies)
        return DecoderOutputs(None, None, pages, head[0], copies)


@dataclass
class CrossStep:
    """One forward of an encoder-decoder's decoder: the self-attention step (ids, positions, slots, its
    context and spans, the wanted rows, the self pages) and what cross-attention reads: the slots of each
    row's encoded input in the cross pages (`ctx_slots`, one segment per input), each row's span of them,
    and the cross pages (k, v per layer), written once per input and only read here."""
    step: DecoderStep
    cross_slots: object
    cross_spans: object
    cross_pages: list = field(default_factory=list)


class EncoderDecoderIO:
    """The graphs of a decoder with cross-attention over its encoder's output, for a self cache and a
    cross cache (both PagedKV, whole-context): the step graph (CrossStep in, logits [R, vocab] and the
    updated self pages out) and the cross graph (encoded rows and their slots in, the cross pages with
    every layer's keys and values of those rows written out). Dims as DecoderIO's; C cross context slots,
    F encoded rows."""

    def __init__(self, cache: PagedKV, cross: PagedKV):
        self.cache, self.cross = cache, cross

    @staticmethod
    def page_inputs(g: GraphBuilder, prefix: str, c: PagedKV) -> list[Value]:
        return [g.input(f"{prefix}{name}_pages.{i}", *c.page_shape(i, j, "P" if not prefix else "CP", "BLK"))
                for i in range(c.layers) for j, name in enumerate("kv")]

    def declare(self, g: GraphBuilder) -> CrossStep:
        attention = Attention(g.input("positions", ("S",), "i64"), g.input("slots", ("S",), "i64"),
                              g.input("ctx_slots", ("T",), "i64"), {0: g.input("spans", ("S", 2), "i64")})
        step = DecoderStep(g.input("ids", ("S",), "i64"), attention, g.input("logit_rows", ("R",), "i64"), None,
                           self.page_inputs(g, "", self.cache))
        return CrossStep(step, g.input("cross_slots", ("C",), "i64"), g.input("cross_spans", ("S", 2), "i64"),
                         self.page_inputs(g, "cross_", self.cross))

    def declare_cross(self, g: GraphBuilder, width: int) -> tuple[Value, Value, list[Value]]:
        """The cross graph's inputs: encoded rows [F, width], their slots [F], the cross pages."""
        return g.input("encoded", ("F", width), "f32"), g.input("slots", ("F",), "i64"), self.page_inputs(g, "cross_", self.cross)

    def feed(self, s: CrossStep) -> dict:
        a = s.step.attention
        named = {"ids": s.step.ids, "positions": a.positions, "slots": a.slots, "ctx_slots": a.ctx_slots, "spans": a.spans[0],
                 "logit_rows": s.step.logit_rows, "cross_slots": s.cross_slots, "cross_spans": s.cross_spans}
        named.update(self.pages_named("", self.cache, s.step.pages))
        named.update(self.pages_named("cross_", self.cross, s.cross_pages))
        return named

    def feed_cross(self, encoded, slots, cross_pages: list) -> dict:
        return {"encoded": encoded, "slots": slots, **self.pages_named("cross_", self.cross, cross_pages)}

    @staticmethod
    def pages_named(prefix: str, c: PagedKV, pages: list) -> dict:
        return {f"{prefix}{kv}_pages.{i}": pages[kv_index(i, j)] for i in range(c.layers) for j, kv in enumerate("kv")}

    def shared(self) -> set[str]:
        return set(self.pages_named("", self.cache, [None] * kv_count(self.cache.layers))) | \
            set(self.pages_named("cross_", self.cross, [None] * kv_count(self.cross.layers)))
