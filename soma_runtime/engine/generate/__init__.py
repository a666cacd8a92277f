"""The `generate` task's runner: a decoder over its paged KV cache (engine: Engine, each request's
Stream), where its layers run (stages), sampling, stop strings, speculative drafts (speculate), the KV
codecs' calibration text, and the one scheduling loop the library and the server share (batching).
What the layers above (tasks, server, tools) use is re-exported here."""
from soma_runtime.engine.generate.batching import Scheduler
from soma_runtime.engine.generate.engine import Engine, GenerationRequest, Stream, Token
from soma_runtime.engine.generate.sampling import MAX_TOP_K, PRESETS, SEED_LIMIT, SamplingParams, sampling_preset
from soma_runtime.engine.generate.speculate import Drafter, DraftModel, PromptLookup
from soma_runtime.engine.generate.stops import check_stops

__all__ = ["MAX_TOP_K", "PRESETS", "SEED_LIMIT", "DraftModel", "Drafter", "Engine", "GenerationRequest", "PromptLookup",
           "SamplingParams", "Scheduler", "Stream", "Token", "check_stops", "sampling_preset"]
