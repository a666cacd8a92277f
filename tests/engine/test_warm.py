"""A decoder is warmed at load (Engine.warm): the plans of a prompt's step and of a decode step exist
before any request, so the first reply is timed on compiled kernels, and the warm-up holds no page."""
from __future__ import annotations

from soma_runtime.tasks import Runtime
from tests.fixtures.decoders import build_model


def test_loading_plans_a_prompt_step_and_a_decode_step_and_holds_nothing(tmp_path):
    build_model("llama", str(tmp_path), num_hidden_layers=1)
    model = Runtime("cpu").load(str(tmp_path), progress=False)
    [stage] = model.engine.stages
    rows = {dict(bindings)["S"] for bindings, _ in stage.program.plans}
    assert 1 in rows and max(rows) > 1
    assert model.engine.pool.in_use == 0
