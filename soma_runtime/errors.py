"""Typed errors; each message names the file, node or field and what was expected."""


class SomaError(Exception):
    """Base of every error the runtime raises on purpose."""


class GraphError(SomaError):
    """A malformed graph: unknown op, dangling input, cycle, shape or dtype mismatch."""


class JetMismatchError(SomaError):
    """Verify mode: a jet's result differs from its atom decomposition beyond the op's tolerance."""


class ModelLoadError(SomaError):
    """A model file is missing, truncated, corrupt or inconsistent."""


class UnsupportedModelError(ModelLoadError):
    """A model type or tensor format the registry does not know (a load that cannot succeed here)."""


class RequestError(SomaError):
    """A bad generation request: parameters out of range, prompt too long."""


class PromptTooLong(RequestError):
    """A prompt that does not fit the model's context."""


class ContextError(RequestError):
    """A conversation's context that cannot keep its budgets, or a saved one for another model."""


class ParallelError(SomaError):
    """A tensor-parallel group that cannot form, a model that cannot be split over it, or a rank gone."""
