"""Graph passes: the fuse pass, run once on a graph before it is planned; dead-node elimination,
constant folding and memory planning, run when a Plan is made."""
from soma_runtime.ir.passes.constfold import fold_constants
from soma_runtime.ir.passes.dce import eliminate_dead_nodes
from soma_runtime.ir.passes.fuse import fuse
from soma_runtime.ir.passes.memplan import MemoryPlan, plan_memory

__all__ = ["MemoryPlan", "eliminate_dead_nodes", "fold_constants", "fuse", "plan_memory"]
