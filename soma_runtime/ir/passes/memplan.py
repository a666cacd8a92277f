"""Memory planning: intermediates get offsets in one reusable arena, assigned by lifetime.

A buffer is live from the step that writes it to the last step that reads it or any view of it
(reshape, slice, ... alias their input). Offsets are first-fit over the free gaps; a node's output
is placed before its inputs are released, so no kernel writes over what it is reading.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from soma_runtime.dtypes import dtype
from soma_runtime.ir.graph import Graph, TensorMeta
from soma_runtime.ir.ops import OPS

ALIGN = 64


@dataclass
class MemoryPlan:
    offsets: dict[str, int]      # tensor name -> byte offset in the arena
    arena_bytes: int
    total_bytes: int             # what the same intermediates would take unshared


def sized(meta: TensorMeta) -> bool:
    """Whether a tensor has a size to plan: dense, every dim known (not one its data decides)."""
    return not dtype(meta.dtype).quantized and all(isinstance(d, int) for d in meta.shape)


def nbytes(meta: TensorMeta) -> int:
    return int(np.prod(meta.shape, dtype=np.int64)) * dtype(meta.dtype).type_size


def plan_memory(graph: Graph, metas: dict[str, TensorMeta]) -> MemoryPlan:
    root: dict[str, str] = {}          # view output -> the buffer it aliases
    last_use: dict[str, int] = {}
    planned: list[tuple[int, str]] = []
    for step, node in enumerate(graph.nodes):
        for i in node.inputs:
            if i is not None:
                last_use[root.get(i, i)] = step
        opdef = OPS[node.op]
        if opdef.view:
            for j, o in enumerate(node.outputs):
                source = node.inputs[opdef.aliased(j)]
                root[o] = root.get(source, source)
        elif len(node.outputs) == 1 and node.outputs[0] not in graph.outputs and sized(metas[node.outputs[0]]):
            planned.append((step, node.outputs[0]))
    for o in graph.outputs:            # graph outputs (and what they alias) live to the end
        last_use[root.get(o, o)] = len(graph.nodes)
    planned = [(s, t) for s, t in planned if t in last_use]   # outputs read by nobody stay unplanned

    free: list[tuple[int, int]] = []   # (offset, size) gaps, sorted by offset
    releases: dict[int, list[str]] = {}
    top, offsets, total = 0, {}, 0
    for step, name in planned:
        _release_before(step, releases, offsets, metas, free)
        size = _padded(metas[name])
        total += size
        slot = next((k for k, (_, gap) in enumerate(free) if gap >= size), None)
        if slot is None:
            offsets[name], top = top, top + size
        else:
            off, gap = free.pop(slot)
            offsets[name] = off
            if gap > size:
                free.insert(slot, (off + size, gap - size))
        releases.setdefault(last_use[name], []).append(name)
    return MemoryPlan(offsets, top, total)


def _padded(meta: TensorMeta) -> int:
    return -(-nbytes(meta) // ALIGN) * ALIGN


def _release_before(step, releases, offsets, metas, free):
    """Return buffers whose last reader ran before `step` to the free gaps, merging neighbours."""
    for s in [s for s in releases if s < step]:
        free.extend((offsets[name], _padded(metas[name])) for name in releases.pop(s))
    free.sort()
    merged: list[tuple[int, int]] = []
    for off, size in free:
        if merged and merged[-1][0] + merged[-1][1] == off:
            merged[-1] = (merged[-1][0], merged[-1][1] + size)
        else:
            merged.append((off, size))
    free[:] = merged
