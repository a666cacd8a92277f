"""`GET /v1/metrics`: the server's counters and each model's scheduler state as Prometheus text."""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from soma_runtime.memory import peak_rss_mb
from soma_runtime.server.registry import DEGRADATIONS, ModelRegistry
from soma_runtime.server.security import label_value


@dataclass
class ServerMetrics:
    requests: Counter = field(default_factory=Counter)        # (route, status) -> count
    ttft_sum: Counter = field(default_factory=Counter)        # model -> seconds to first token, summed
    ttft_count: Counter = field(default_factory=Counter)

    def first_token(self, model_id: str, seconds: float) -> None:
        self.ttft_sum[model_id] += seconds
        self.ttft_count[model_id] += 1


def label(**labels) -> str:
    return "{" + ",".join(f'{k}="{label_value(v)}"' for k, v in labels.items()) + "}"


def number(value) -> str:
    """A sample's value, exactly: integers in full (bytes, counts), other values as Python writes them."""
    return str(int(value)) if float(value).is_integer() else repr(float(value))


def render(metrics: ServerMetrics, registry: ModelRegistry) -> str:
    lines: list[str] = []

    def family(name: str, kind: str, help_text: str, samples: list[tuple[dict, float]]) -> None:
        lines.extend([f"# HELP {name} {help_text}", f"# TYPE {name} {kind}"])
        lines.extend(f"{name}{label(**labels) if labels else ''} {number(value)}" for labels, value in samples)

    family("soma_http_requests_total", "counter", "HTTP requests by route and status.",
           [({"route": r, "status": s}, n) for (r, s), n in sorted(metrics.requests.items())])
    models = list(registry.models.values())
    schedulers = [(s.id, s.scheduler) for s in models if s.scheduler is not None]
    per_model = [
        ("soma_generation_requests_total", "counter", "Generation requests submitted.", lambda st, sc: st.requests),
        ("soma_generation_cancelled_total", "counter", "Requests ended by a client leaving.", lambda st, sc: st.cancelled),
        ("soma_prompt_tokens_total", "counter", "Prompt tokens received.", lambda st, sc: st.prompt_tokens),
        ("soma_prompt_tokens_cached_total", "counter", "Prompt tokens served from the prefix cache.", lambda st,
         sc: st.cached_tokens),
        ("soma_generated_tokens_total", "counter", "Tokens generated.", lambda st, sc: st.generated_tokens),
        ("soma_decode_steps_total", "counter", "Batched forward steps run.", lambda st, sc: st.steps),
        ("soma_decode_steps_ahead_total", "counter", "Steps launched before the tokens of the one before them were read.",
         lambda st, sc: st.ran_ahead),
        ("soma_tokens_per_second", "gauge", "Generated tokens per second of busy scheduler time.",
         lambda st, sc: st.generated_tokens / st.step_seconds if st.step_seconds else 0.0),
        ("soma_draft_tokens_total", "counter", "Speculative draft tokens proposed (finished requests).",
         lambda st, sc: st.drafted_tokens),
        ("soma_draft_tokens_accepted_total", "counter", "Speculative draft tokens the model kept (finished requests).",
         lambda st, sc: st.accepted_tokens),
        ("soma_queue_depth", "gauge", "Requests waiting to join the batch.", lambda st, sc: sc.queue_depth),
        ("soma_running_sequences", "gauge", "Sequences in the running batch.", lambda st, sc: len(sc.running)),
        ("soma_batch_size", "gauge", "Sequences in the latest step.", lambda st, sc: st.last_batch),
        ("soma_batch_size_max", "gauge", "Most sequences one step has run.", lambda st, sc: st.max_batch),
        ("soma_kv_pages_in_use", "gauge", "KV cache pages held by sequences.", lambda st, sc: sc.pages.in_use),
        ("soma_kv_pages_cached", "gauge", "KV pages kept for prefix reuse, held by nobody.", lambda st, sc: sc.pages.cached),
        ("soma_kv_pages_total", "gauge", "KV cache pages in the pool.", lambda st, sc: sc.pages.total),
    ]
    for name, kind, help_text, read in per_model:
        family(name, kind, help_text, [({"model": mid}, read(sc.stats, sc)) for mid, sc in schedulers])
    family("soma_time_to_first_token_seconds_sum", "counter", "Seconds from request to first token, summed.",
           [({"model": m}, v) for m, v in metrics.ttft_sum.items()])
    family("soma_time_to_first_token_seconds_count", "counter", "Requests that got a first token.",
           [({"model": m}, v) for m, v in metrics.ttft_count.items()])
    family("soma_model_memory_bytes", "gauge", "Memory a model may hold: weights plus a full context of KV cache.",
           [({"model": s.id}, s.bytes) for s in models])
    family("soma_memory_budget_bytes", "gauge", "The server's memory budget for models.", [({}, registry.budget)])
    family("soma_models_evicted_total", "counter", "Models unloaded to make room.", [({}, registry.evicted)])
    family("soma_memory_degradations_total", "counter", "Rungs of the memory ladder taken: compress_kv, unload_model, "
           "reduce_context.", [({"step": step}, registry.degradations[step]) for step in DEGRADATIONS])
    family("soma_peak_rss_bytes", "gauge", "Peak resident memory of the server process.", [({}, peak_rss_mb() * 2**20)])
    return "\n".join(lines) + "\n"
