"""The tensor-parallel group this process belongs to, over torch.distributed: gloo between host
processes, NCCL between GPUs (one process a GPU), and a gloo side group, without a deadline, for the
host values the ranks exchange beside the steps' tensors. One group a process; every rank runs the same graph
shapes in the same order, so the collectives meet. Knows processes and tensors, nothing of models.
"""
from __future__ import annotations

import datetime
import os
from dataclasses import dataclass

import numpy as np

from soma_runtime.errors import ParallelError


@dataclass(frozen=True)
class Group:
    rank: int
    size: int
    device: bool            # whether the steps' tensors travel between GPUs (NCCL) or host processes (gloo)


_group: Group | None = None
_host = None                # the gloo group for host values: rank 0's steps, which the others await however long
IDLE = datetime.timedelta(days=365)      # (a server may idle; a rank that dies closes its connections at once)


def _torch_distributed():
    try:
        import torch.distributed as dist
    except ImportError:
        raise ParallelError("tensor parallel runs on torch.distributed: install torch (pip install torch)") from None
    return dist


def join(rank: int, size: int, address: str, device: bool = False, timeout_s: float = 60.0) -> Group:
    """Join the group of `size` ranks meeting at `address` (host:port) as `rank`; with `device`, this
    process's GPU is cuda:<rank>. ParallelError if the others do not come within `timeout_s`."""
    global _group, _host
    if _group is not None:
        raise ParallelError(f"this process is rank {_group.rank} of a group of {_group.size} already")
    dist = _torch_distributed()
    timeout = datetime.timedelta(seconds=timeout_s)
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")           # no NVLink multicast: it can wedge shared GPUs
    if device:
        import torch
        torch.cuda.set_device(rank)
    try:
        dist.init_process_group("nccl" if device else "gloo", init_method=f"tcp://{address}", rank=rank, world_size=size,
                                timeout=timeout, **({"device_id": torch.device("cuda", rank)} if device else {}))
        _host = dist.new_group(backend="gloo", timeout=IDLE)
    except (RuntimeError, ValueError) as e:
        if dist.is_initialized():                # a half-formed group must not stand in the next one's way
            dist.destroy_process_group()
        raise ParallelError(f"rank {rank} of {size} could not join the group at {address}: {e}") from None
    _group = Group(rank, size, device)
    return _group


def leave() -> None:
    """Leave the group (every rank must); a process that never joined has nothing to do."""
    global _group, _host
    if _group is not None:
        _torch_distributed().destroy_process_group()
        _group, _host = None, None


def current() -> Group | None:
    return _group


def _member() -> Group:
    if _group is None:
        raise ParallelError("a collective op ran in a process that is in no tensor-parallel group")
    return _group


def _broken(e: RuntimeError) -> ParallelError:
    """A collective that failed (a rank gone, a timeout), said in a line."""
    return ParallelError(f"rank {_group.rank}: the tensor-parallel group broke off ({str(e).split('. This is')[0]})")


def summed_(tensor) -> None:
    """Sum `tensor` (a torch tensor) over the ranks, in place."""
    _member()
    try:
        _torch_distributed().all_reduce(tensor)
    except RuntimeError as e:
        raise _broken(e) from None


def summed(x: np.ndarray) -> np.ndarray:
    """A host array summed over the ranks (a copy; gloo sums in place)."""
    import torch
    total = torch.from_numpy(np.array(x, copy=True))
    summed_(total)
    return total.numpy()


def stacked(x: np.ndarray) -> np.ndarray:
    """Every rank's `x` (host arrays of one shape), stacked in rank order on a new first axis."""
    import torch
    group = _member()
    mine = torch.from_numpy(np.ascontiguousarray(x))
    parts = [torch.empty_like(mine) for _ in range(group.size)]
    try:
        _torch_distributed().all_gather(parts, mine)
    except RuntimeError as e:
        raise _broken(e) from None
    return np.stack([p.numpy() for p in parts])


def shared(value=None):
    """Rank 0's `value` (any picklable host value) on every rank: each other rank passes nothing."""
    group = _member()
    box = [value if group.rank == 0 else None]
    try:
        _torch_distributed().broadcast_object_list(box, src=0, group=_host)
    except RuntimeError as e:
        raise _broken(e) from None
    return box[0]
