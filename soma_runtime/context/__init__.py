"""Context management (SPEC "context management"): a conversation's blocks and budgets, rendered as the
model sees them, and its sessions on disk (blocks); the retrieval index of a folder of linked pages
(index). What the layers above (tasks, server) use is re-exported here."""
from soma_runtime.context.blocks import BLOCKS, BUDGETED, Context, Cut, identity, read_session
from soma_runtime.context.index import PageIndex, RetrievalError, Weights

__all__ = ["BLOCKS", "BUDGETED", "Context", "Cut", "PageIndex", "RetrievalError", "Weights", "identity", "read_session"]
