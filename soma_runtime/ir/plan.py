"""A Plan: a graph compiled for bound shapes on one backend, runnable many times without re-planning.

Making a plan runs the passes (dead nodes, constant folding), binds symbolic dims, picks each
node's kernel from the jet registry once, and lays intermediates out in one arena, whose views
(reshapes, splits) are made then too. Running it calls the prepared steps' kernels through one
generated function (codegen.py): no lookups, no shape inference, no allocation for planned tensors.
A dim left `free` may take any size per run; only graph inputs may carry it (the decoder's
context length: its slots and spans vary per step, no intermediate does). A dim only the data decides
(a range's length, a nonzero's count) is bound once its node has run, and the attributes that hold
it (a reshape to it) resolve per run: such tensors, and what follows from them, are left out of the
arena and sized by their kernels.
A plan given a `RunBudget` checks every size against it once the size is known and before anything of
it is allocated: static sizes when it is made, sizes the data decides as each is resolved.
"""
from __future__ import annotations

import copy
import functools
import math
from dataclasses import dataclass

import numpy as np
from numpy._core.umath import _extobj_contextvar, _make_extobj

from soma_runtime.dtypes import QTensor, dtype
from soma_runtime.errors import GraphError, RequestError
from soma_runtime.ir.backend import Backend
from soma_runtime.ir.builder import validate
from soma_runtime.ir.codegen import Compiled, compile_steps
from soma_runtime.ir.graph import Graph, Node, Sym, TensorMeta, is_dynamic, meta_of, names_in, resolve
from soma_runtime.ir.jets import REGISTRY
from soma_runtime.ir.ops import OPS
from soma_runtime.ir.passes import eliminate_dead_nodes, fold_constants, plan_memory


@dataclass(frozen=True)
class RunBudget:
    """The most one run of a graph may compute, in bytes: past it, a RequestError names the node, its
    op and the size, raised before that size is allocated."""
    tensor_bytes: int = 1 << 30          # any one tensor a node computes (a constant folded for the plan too)
    output_bytes: int = 1 << 30          # the graph's outputs together
    work_bytes: int = 4 << 30            # the arena (the intermediates live at once), and apart the
                                         # constants a plan computes

    def check(self, node: Node, name: str, meta: TensorMeta) -> int:
        """The bytes of `name` (of shape `meta`, every dim known), RequestError past `tensor_bytes`."""
        size = meta_bytes(meta)
        if size > self.tensor_bytes:
            raise RequestError(f"node {node.name!r} ({node.op}): its output {name!r} of shape {list(meta.shape)} "
                               f"{meta.dtype} is {size} bytes, past the {self.tensor_bytes} a tensor may have")
        return size

    def check_outputs(self, size: int, names: list[str]) -> None:
        if size > self.output_bytes:
            raise RequestError(f"the graph's outputs {', '.join(names)} come to {size} bytes, past the "
                               f"{self.output_bytes} they may have together")


def meta_bytes(meta: TensorMeta) -> int:
    """Bytes of a tensor whose dims are all known, in Python integers (a product of huge dims does not wrap)."""
    dt = dtype(meta.dtype)
    return -(-math.prod(max(0, d) for d in meta.shape) // dt.block_size) * dt.type_size


QUIET = _make_extobj(all="ignore")    # np.errstate(all="ignore")'s state, made once: entering np.errstate
                                      # makes it anew each time, a third of a one-node graph's run


def failed(node: Node, e: Exception) -> RequestError:
    """An index or size the data gave that the node's kernel cannot take (a Gather past the end)."""
    return RequestError(f"node {node.name!r} ({node.op}): {type(e).__name__}: {str(e)[:300]}")


@dataclass
class Step:
    kernel: object
    inputs: list[str | None]
    outputs: list[str]
    attrs: dict
    out: np.ndarray | None       # arena view the kernel writes into, if planned
    node: Node
    binds: tuple = ()            # (output, axis, name): sizes only the data decides, read off what it made
    lazy: bool = False           # attrs hold such sizes, resolved when the step runs
    sized: tuple = ()            # (output, meta, is a graph output): outputs sized by such sizes, checked
                                 # against the budget before the step runs

    @property
    def single(self) -> bool:
        return len(self.outputs) == 1


def bind_attrs(attrs: dict, bindings: dict[str, int]) -> dict:
    """Resolve symbolic sizes inside tuple attrs (a reshape to (B, S, -1)); a size the data decides stays
    symbolic until its node has run."""
    def one(v):
        if isinstance(v, (tuple, list)):
            return tuple(one(Sym(x)) if isinstance(x, str) else one(x) for x in v)
        if isinstance(v, Sym):
            return v if is_dynamic(v) and not names_in(v) <= bindings.keys() else resolve(v, bindings)
        return v
    return {k: (v if isinstance(v, str) else one(v)) for k, v in attrs.items()}


def symbolic_attrs(attrs: dict) -> bool:
    """Whether a size is still symbolic anywhere in the attrs (a pad's (before, after) pairs nest)."""
    def symbolic(v) -> bool:
        return isinstance(v, Sym) or isinstance(v, (tuple, list)) and any(symbolic(x) for x in v)
    return any(symbolic(v) for v in attrs.values())


def dynamic_names(meta: TensorMeta) -> list[tuple[int, str]]:
    """The axes of a planned output whose size is a name only the data decides (bound when it is made)."""
    return [(axis, d.expr) for axis, d in enumerate(meta.shape) if is_dynamic(d) and names_in(d) == {d.expr}]


def bindings_from(graph: Graph, inputs: dict) -> dict[str, int]:
    """Read symbolic dims off the actual input arrays, checking concrete dims and repeats agree."""
    found: dict[str, int] = {}
    for name, meta in graph.inputs.items():
        if name not in inputs:
            raise GraphError(f"missing graph input {name!r}")
        shape = np.shape(inputs[name]) if not isinstance(inputs[name], QTensor) else inputs[name].shape
        if len(shape) != meta.ndim:
            raise GraphError(f"input {name!r}: expected rank {meta.ndim} {list(meta.shape)}, got shape {list(shape)}")
        for d, n in zip(meta.shape, shape):
            if isinstance(d, int) and d != n or isinstance(d, Sym) and found.setdefault(d.expr, n) != n:
                raise GraphError(f"input {name!r}: shape {list(shape)} does not match {list(meta.shape)}")
    return found


def fits(actual: tuple, planned: tuple) -> bool:
    return len(actual) == len(planned) and all(isinstance(p, Sym) or a == p for a, p in zip(actual, planned))


class Plan:
    def __init__(self, graph: Graph, backend: Backend, bindings: dict[str, int] | None = None,
                 memory_plan: bool = True, free: tuple[str, ...] = (), placed: dict | None = None,
                 budget: RunBudget | None = None):
        """`placed`: the graph's constants already on a device backend, by name, shared by every plan of
        the graph, so the weights go to the device once, not once a plan (what folding makes at a plan's sizes
        is placed for that plan alone). `budget`: the sizes a run may compute (None: any)."""
        self.backend, self.budget, self.folded = backend, budget, 0
        self.fold_backend = backend.fallback or backend       # constants fold where they live: the host
        self.bindings = dict(bindings or {})
        self.free = frozenset(free)
        g = copy.copy(graph)
        g.nodes = [copy.copy(n) for n in graph.nodes]
        g.constants = dict(graph.constants)
        validate(g)
        eliminate_dead_nodes(g)
        fold_constants(g, self._run_once)
        self.graph = g
        self.metas = self._bind_metas(g)
        self.output_bytes = self._check_sizes(g) if budget else 0
        self.memory = plan_memory(g, self.metas) if memory_plan and backend.host_arena else None
        if budget and self.memory and self.memory.arena_bytes > budget.work_bytes:
            raise RequestError(f"a run of the graph at these sizes holds {self.memory.arena_bytes} bytes of "
                               f"intermediates at once, past the {budget.work_bytes} it may")
        self.arena = np.empty(self.memory.arena_bytes if self.memory else 0, np.uint8)
        self.steps = [self._step(n) for n in g.nodes]
        self.fixed = self._fix_views() if self.memory else {}
        self.dead = self._last_reads()
        self.input_shapes = {name: tuple(meta.bind(self.bindings, self.free).shape) for name, meta in g.inputs.items()}
        self.exact_inputs = {name for name, shape in self.input_shapes.items() if not any(isinstance(d, Sym) for d in shape)}
        if backend.device:                                      # weights go to a device backend once
            placed = {} if placed is None else placed
            for name, value in g.constants.items():
                if graph.constants.get(name) is not value:      # folded at these sizes (a range over the batch):
                    g.constants[name] = backend.place(value)    # this plan's own
                    continue
                if name not in placed:
                    placed[name] = backend.place(value)
                g.constants[name] = placed[name]

    @classmethod
    def for_inputs(cls, graph: Graph, backend: Backend, inputs: dict, **kw) -> Plan:
        return cls(graph, backend, bindings=bindings_from(graph, inputs), **kw)

    def _run_once(self, node: Node, inputs: list):
        """A constant node computed now, its symbolic sizes bound (GraphError where one is free)."""
        attrs = bind_attrs(node.attrs, self.bindings)
        if symbolic_attrs(attrs):
            raise GraphError(f"{node.name}: a size its data decides is not known before the graph runs")
        metas = [None if x is None else meta_of(x) for x in inputs]
        if self.budget:
            self._check_folded(node, inputs, metas, attrs)
        kernel = REGISTRY.kernel_for(OPS[node.op], metas, attrs, self.fold_backend)
        try:
            return kernel(*inputs, **OPS[node.op].full_attrs(attrs))
        except (IndexError, ValueError) as e:
            raise failed(node, e) from None

    def _check_folded(self, node: Node, inputs: list, metas: list, attrs: dict) -> None:
        """A constant node's outputs against the budget, before its kernel computes them."""
        for name, meta in zip(node.outputs, OPS[node.op].infer(metas, attrs, node.name)):
            own = {d.expr for d in meta.shape if is_dynamic(d)}
            if own:
                meta = meta.bind(dict.fromkeys(own, self._count(node, inputs)))
            self.folded += self.budget.check(node, name, meta)
        if self.folded > self.budget.work_bytes:
            raise RequestError(f"node {node.name!r} ({node.op}): the constants a run of the graph computes come to "
                               f"{self.folded} bytes, past the {self.budget.work_bytes} it may hold")

    @staticmethod
    def _count(node: Node, inputs: list) -> int:
        try:
            return OPS[node.op].count(*inputs, **OPS[node.op].full_attrs(node.attrs))
        except ValueError as e:
            raise failed(node, e) from None

    def _check_sizes(self, g: Graph) -> int:
        """Every size the bindings fixed against the budget, before the arena is laid out; the bytes of
        the graph's outputs so far known (those the data sizes are counted as they run)."""
        def known(name: str) -> bool:
            return not any(isinstance(d, Sym) for d in self.metas[name].shape)
        for node in g.nodes:
            for name in node.outputs:
                if known(name):
                    self.budget.check(node, name, self.metas[name])
        total = sum(meta_bytes(self.metas[o]) for o in g.outputs if known(o))
        self.budget.check_outputs(total, g.outputs)
        return total

    def _bind_metas(self, g: Graph) -> dict[str, TensorMeta]:
        metas = {k: m.bind(self.bindings, self.free) for k, m in g.inputs.items()}
        metas.update({k: meta_of(v) for k, v in g.constants.items()})
        for n in g.nodes:
            n.attrs = bind_attrs(n.attrs, self.bindings)
            ins = [None if i is None else metas[i] for i in n.inputs]
            for name, meta in zip(n.outputs, OPS[n.op].infer(ins, n.attrs, n.name)):
                if any(isinstance(d, Sym) and not is_dynamic(d) for d in meta.shape):
                    raise GraphError(f"{n.name}: output {name!r} has shape {list(meta.shape)}; free dims may only size inputs")
                metas[name] = meta
        return metas

    def _step(self, n: Node) -> Step:
        ins = [None if i is None else self.metas[i] for i in n.inputs]
        kernel = REGISTRY.kernel_for(OPS[n.op], ins, n.attrs, self.backend)
        out = None
        if self.memory and n.outputs[0] in self.memory.offsets:
            meta = self.metas[n.outputs[0]]
            off = self.memory.offsets[n.outputs[0]]
            np_dtype = dtype(meta.dtype).numpy
            count = int(np.prod(meta.shape, dtype=np.int64))
            out = self.arena[off: off + count * np_dtype.itemsize].view(np_dtype).reshape(meta.shape)
        binds = tuple((k, axis, name) for k, o in enumerate(n.outputs) for axis, name in dynamic_names(self.metas[o]))
        sized = tuple((k, self.metas[o], o in self.graph.outputs) for k, o in enumerate(n.outputs)
                      if self.budget and any(is_dynamic(d) for d in self.metas[o].shape))
        return Step(kernel, list(n.inputs), list(n.outputs), OPS[n.op].full_attrs(n.attrs), out, n, binds,
                    symbolic_attrs(n.attrs), sized)

    def _fix_views(self) -> dict:
        """Views (reshape, split, ...) of arena buffers and constants are the same views every run:
        made once here, their steps leave the run loop. A view op that had to copy stays a step."""
        known = {step.outputs[0]: step.out for step in self.steps if step.out is not None}
        known.update(self.graph.constants)
        fixed, kept = {}, []
        for step, node in zip(self.steps, self.graph.nodes):
            source = known.get(node.inputs[0]) if node.inputs and node.inputs[0] is not None else None
            if OPS[node.op].view and isinstance(source, np.ndarray) and all(i is None or i in known for i in node.inputs):
                result = step.kernel(*[None if i is None else known[i] for i in step.inputs], **step.attrs)
                results = result if isinstance(result, tuple) else (result,)
                if all(isinstance(r, np.ndarray) and np.may_share_memory(r, source) for r in results):
                    fixed.update(zip(step.outputs, results))
                    known.update(zip(step.outputs, results))
                    continue
            kept.append(step)
        self.steps = kept
        return fixed

    def _last_reads(self) -> list[tuple[str, ...]]:
        """Per step, the intermediates no later step reads. They leave the run's values after it, so memory
        the arena does not hold (a device backend's caching allocator, sizes the data decides) serves the
        steps after: a step holds what is live, not everything it has computed."""
        kept = {*self.graph.outputs, *self.graph.constants, *self.graph.inputs}
        last = {name: k for k, step in enumerate(self.steps) for name in step.inputs if name is not None and name not in kept}
        dead: list[list[str]] = [[] for _ in self.steps]
        for name, k in last.items():
            dead[k].append(name)
        return [tuple(names) for names in dead]

    @functools.cached_property
    def hosted(self) -> bool:
        """Whether a step runs on the host for a device backend (its inputs copied there and back): such a
        plan cannot be captured as a CUDA graph."""
        return any(getattr(step.kernel, "hosted", False) for step in self.steps)

    def run(self, inputs: dict) -> list:
        given = {}
        for name, shape in self.input_shapes.items():
            value = inputs.get(name)
            got = None if value is None else tuple(value.shape) if hasattr(value, "shape") else np.shape(value)
            if got != shape and (got is None or name in self.exact_inputs or not fits(got, shape)):
                raise GraphError(f"input {name!r}: expected shape {list(shape)}, got {None if got is None else list(got)}")
            given[name] = self.backend.place(value) if self.backend.device else value
        quiet = _extobj_contextvar.set(QUIET)        # inf/nan follow IEEE semantics; no warning per op
        try:
            outputs = self._run_compiled(given) if self.compiled else self._run_steps(given)
        finally:
            _extobj_contextvar.reset(quiet)
        if not self.memory:
            return outputs
        # outputs may alias the arena, which the next run overwrites
        return [np.array(v) if np.may_share_memory(v, self.arena) else v for v in outputs]

    @functools.cached_property
    def compiled(self) -> Compiled | None:
        """The steps as one function, made on the first run (their kernels bound then); None where a size
        the data decides rebinds attributes as the run goes: such plans run the steps as a loop."""
        if any(step.lazy or step.sized or step.binds for step in self.steps):
            return None
        return compile_steps(self.steps, self.dead, {**self.graph.constants, **self.fixed}, list(self.graph.inputs),
                             self.graph.outputs)

    def _run_compiled(self, given: dict) -> list:
        try:
            return self.compiled.run(given)
        except (IndexError, ValueError) as e:
            k = self.compiled.failing_step(e.__traceback__)
            if k is None:
                raise
            raise failed(self.steps[k].node, e) from None

    def _run_steps(self, given: dict) -> list:
        env = {**self.graph.constants, **self.fixed, **given}
        bindings = dict(self.bindings)        # and the sizes the data decides, as their nodes run
        outputs = self.output_bytes
        for step, dead in zip(self.steps, self.dead):
            out = step.out
            attrs = bind_attrs(step.attrs, bindings) if step.lazy else step.attrs
            inputs = [None if i is None else env[i] for i in step.inputs]
            if step.sized:
                outputs += self._check_resolved(step, inputs, bindings)
                self.budget.check_outputs(outputs, self.graph.outputs)
            try:
                result = step.kernel(*inputs, out=out, **attrs)
            except (IndexError, ValueError) as e:
                raise failed(step.node, e) from None
            if out is not None and result is not out:
                out[...] = result
                result = out
            if step.single:
                env[step.outputs[0]] = result
            else:
                env.update(zip(step.outputs, result))
            for k, axis, name in step.binds:
                bindings[name] = int(np.shape(env[step.outputs[k]])[axis])
            for name in dead:
                del env[name]
        return [env[o] for o in self.graph.outputs]

    def _check_resolved(self, step: Step, inputs: list, bindings: dict) -> int:
        """A step's outputs sized by the data, against the budget before it runs (the length a range or a
        nonzero decides counted from its inputs); the bytes of those that are graph outputs."""
        own = {name for _, _, name in step.binds if name not in bindings}      # the node's own: none bound before it
        known = {**bindings, **dict.fromkeys(own, self._count(step.node, inputs))} if own else bindings
        total = 0
        for k, meta, is_output in step.sized:
            size = self.budget.check(step.node, step.outputs[k], meta.bind(known))
            total += size if is_output else 0
        return total
