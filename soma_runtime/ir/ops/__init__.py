"""The closed op set, each op declared once (base.OpDef): inputs, attrs, shape/dtype rule and its
atom decomposition. Importing the package fills `OPS` from every family's module.
"""
from soma_runtime.ir.ops import (  # noqa: F401  (declares the ops)
    adapter,
    cache,
    chain,
    collective,
    conv,
    detection,
    elementwise,
    layout,
    linear,
    moe,
    norm,
    primitive,
)
from soma_runtime.ir.ops.base import OPS, OpDef, ShapeError, as_tuple
from soma_runtime.ir.ops.conv import source_scale
from soma_runtime.ir.ops.linear import EPILOGUES, GATED

__all__ = ["EPILOGUES", "GATED", "OPS", "OpDef", "ShapeError", "as_tuple", "source_scale"]
