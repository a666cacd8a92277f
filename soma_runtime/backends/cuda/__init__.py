"""The CUDA backend: Triton jets on NVIDIA GPUs; torch holds device memory (and, later, streams and
CUDA graphs). Weights go to the device once, in their stored format. An op without a CUDA jet for
its dtypes runs on the CPU backend with its inputs copied over, and says so once (never silently).

Importing the package registers every jet. Available when torch sees a GPU and Triton imports; with
TRITON_INTERPRET=1 the same kernels run on the CPU through Triton's interpreter (tests, CI).
"""
from __future__ import annotations

from soma_runtime.backends.cuda.device import INTERPRET, device, fetch, fetch_soon, free_bytes, place, zeros  # noqa: F401  (the backend's interface)

NAME = "cuda"
FALLBACK = "cpu"           # where ops without a CUDA jet run
HOST_ARENA = False         # intermediates live in torch's caching allocator, not a planned host arena

from soma_runtime.backends.cuda import attention, blocks, elementwise, layout, linear, rope, sampling  # noqa: F401  (registers jets)
from soma_runtime.backends.cuda.graphs import graphed as _graphed

# decode steps replay as CUDA graphs on a GPU (the interpreter has none)
graphed = _graphed if device().type == "cuda" else None


def detect() -> dict:
    import torch
    import triton
    if INTERPRET:
        return {"available": True, "mode": "TRITON_INTERPRET=1 (kernels interpreted on the CPU)", "triton": triton.__version__}
    if not torch.cuda.is_available():
        return {"available": False, "error": "torch sees no CUDA device", "torch": torch.__version__}
    props = torch.cuda.get_device_properties(0)
    return {"available": True, "device": props.name, "capability": f"{props.major}.{props.minor}",
            "memory_gb": round(props.total_memory / 2**30, 1), "multiprocessors": props.multi_processor_count,
            "devices": torch.cuda.device_count(), "torch": torch.__version__, "triton": triton.__version__}
