"""Chained launches (PDL): a kernel may start while the one before it runs, so it must wait first."""
from __future__ import annotations

import pytest

from tests.backends import BACKENDS

pytestmark = pytest.mark.skipif("cuda" not in BACKENDS, reason="needs a GPU or Triton (interpreted)")


def test_a_kernel_that_does_not_wait_is_refused():
    import triton

    from soma_runtime.backends.cuda.chain import chained

    @triton.jit
    def eager_kernel(x_ptr):
        x_ptr += 1

    with pytest.raises(TypeError, match="after_prior"):
        chained(eager_kernel)


def test_every_kernel_is_chained():
    """A kernel left out would still be right, but would break the overlap where it runs."""
    import importlib
    import pkgutil

    from soma_runtime.backends import cuda
    from soma_runtime.backends.cuda.chain import chained
    modules = [importlib.import_module(f"{cuda.__name__}.{m.name}") for m in pkgutil.iter_modules(cuda.__path__)]
    kernels = {f"{m.__name__}.{name}": value for m in modules for name, value in vars(m).items() if name.endswith("_kernel")}
    assert len(kernels) > 15 and all(isinstance(k, chained) for k in kernels.values()), \
        [name for name, k in kernels.items() if not isinstance(k, chained)]
