"""Generation behaviour on the bundled model: stop strings, max_tokens, metrics; the CLI end to end."""
from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest

from soma_runtime.tasks import Runtime
from tests.fixtures.decoders import build_model


def test_stop_string_ends_generation_and_is_not_emitted(smol):
    free = smol.complete("1, 2, 3, 4, 5,", max_tokens=12, temperature=0)
    assert " 8," in free, free                       # the model counts on; stop before 8
    tokens = list(smol.generate("1, 2, 3, 4, 5,", max_tokens=12, temperature=0, stop=[" 8"]))
    text = "".join(t.text for t in tokens)
    assert text == free[: free.index(" 8")] and tokens[-1].finish_reason == "stop"


def test_max_tokens_and_metrics(smol):
    tokens = list(smol.generate("Once upon a time", max_tokens=5, temperature=0))
    m = smol.metrics()
    assert len(tokens) == 5 and tokens[-1].finish_reason == "length"
    assert m["generated_tokens"] == 5 and m["prefill_ms"] > 0 and m["decode_tok_s"] > 0 and m["peak_rss_mb"] > 0


def test_sharded_checkpoints_load(tmp_path):
    from transformers import AutoModelForCausalLM
    model, tok = build_model("llama", str(tmp_path / "one"))
    model.save_pretrained(str(tmp_path / "one"), max_shard_size="40KB")
    ids = tok.encode("Hello world").ids
    sharded = Runtime().load(str(tmp_path / "one"), progress=False)
    assert len(list((tmp_path / "one").glob("*.safetensors"))) > 1
    reference = AutoModelForCausalLM.from_pretrained(str(tmp_path / "one")).eval()
    import torch
    with torch.no_grad():
        want = reference(torch.tensor([ids])).logits[0].numpy()
    np.testing.assert_allclose(sharded.logits(ids), want, atol=1e-4 * max(1, np.abs(want).max()), rtol=0)


def soma(*args, stdin=None):
    return subprocess.run([sys.executable, "-m", "soma_runtime.cli.main", *args], input=stdin, capture_output=True,
                          text=True, timeout=300, check=False)


def test_cli_run_reads_the_prompt_from_stdin_and_streams_only_text(smol):
    want = smol.complete("The capital of France is", max_tokens=8, temperature=0)
    r = soma("run", "--prompt", "-", "--temperature", "0", "-n", "8", stdin="The capital of France is")
    assert r.returncode == 0, r.stderr
    assert r.stdout == want + "\n"


def test_cli_models_info_and_bench():
    info = soma("models", "info")
    assert info.returncode == 0, info.stderr
    assert json.loads(info.stdout)["layers"] == 30
    bench = soma("bench", "--prompt-tokens", "16", "--new-tokens", "8", "--runs", "1", "--json")
    assert bench.returncode == 0, bench.stderr
    result = json.loads(bench.stdout)
    assert result["decode_tok_s"] > 0 and result["prefill_tok_s"] > 0 and result["GB/s"] > 0


def test_runtime_lists_and_unloads_models(tmp_path):
    from soma_runtime.errors import RequestError
    build_model("qwen2", str(tmp_path / "m"))
    rt = Runtime()
    model = rt.load(str(tmp_path / "m"), progress=False)
    assert [m["id"] for m in rt.list_models()] == [model.id]
    assert rt.memory_stats()["per_model_weight_bytes"][model.id] > 0
    rt.unload(model.id)
    assert rt.list_models() == []
    with pytest.raises(RequestError, match="no loaded model"):
        rt.unload(model.id)
