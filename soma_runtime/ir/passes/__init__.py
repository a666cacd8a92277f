"""Graph passes run when a Plan is made: dead-node elimination, constant folding, memory planning."""
from soma_runtime.ir.passes.constfold import fold_constants
from soma_runtime.ir.passes.dce import eliminate_dead_nodes
from soma_runtime.ir.passes.memplan import MemoryPlan, plan_memory

__all__ = ["MemoryPlan", "eliminate_dead_nodes", "fold_constants", "plan_memory"]
