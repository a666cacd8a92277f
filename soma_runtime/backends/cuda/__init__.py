"""The CUDA backend: Triton jets on NVIDIA GPUs; torch holds device memory, streams and CUDA graphs.
Weights go to the device once, in their stored format. An op without a CUDA jet for its dtypes runs
on the CPU backend with its inputs copied over, and says so once (never silently).

Importing the package registers every jet; `BACKEND` is its one public surface. Available when torch
sees a GPU and Triton imports; with TRITON_INTERPRET=1 the same kernels run on the CPU through
Triton's interpreter (tests, CI).
"""
from __future__ import annotations

from soma_runtime.backends import get
from soma_runtime.backends.cuda import attention, blocks, collective, conv, elementwise, layout, linear, primitive, rope, sampling  # noqa: F401  (registers jets)
from soma_runtime.backends.cuda.device import INTERPRET, device, fetch, fetch_soon, free_bytes, place, zeros
from soma_runtime.backends.cuda.graphs import GraphedSteps
from soma_runtime.ir.backend import Backend, Captures


class CudaBackend(Backend):
    name = "cuda"
    device = True
    host_arena = False          # intermediates live in torch's caching allocator
    asynchronous = True         # a step is queued before the last one's results are read
    compiles = not INTERPRET    # Triton's kernels, and the decode steps' CUDA graphs

    @property
    def fallback(self) -> Backend:
        return get("cpu")

    def detect(self) -> dict:
        import torch
        import triton
        if INTERPRET:
            return {"available": True, "mode": "TRITON_INTERPRET=1 (kernels interpreted on the CPU)",
                    "triton": triton.__version__}
        if not torch.cuda.is_available():
            return {"available": False, "error": "torch sees no CUDA device", "torch": torch.__version__}
        props = torch.cuda.get_device_properties(0)
        return {"available": True, "device": props.name, "capability": f"{props.major}.{props.minor}",
                "memory_gb": round(props.total_memory / 2**30, 1), "multiprocessors": props.multi_processor_count,
                "devices": torch.cuda.device_count(), "torch": torch.__version__, "triton": triton.__version__}

    def place(self, value):
        return place(value)

    def fetch(self, value):
        return fetch(value)

    def fetch_soon(self, value):
        return fetch_soon(value)

    def zeros(self, shape, dtype):
        return zeros(shape, dtype)

    def free_bytes(self):
        return free_bytes()

    def captures(self) -> Captures:
        """Decode steps replay as CUDA graphs on a GPU (the interpreter has none)."""
        return GraphedSteps() if device().type == "cuda" else Captures()


BACKEND = CudaBackend()
