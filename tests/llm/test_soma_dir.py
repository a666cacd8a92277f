"""soma directories: `soma-runtime import` writes one; it loads to the same model with its defaults."""
from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import tomllib

from soma_runtime.tasks import Runtime
from tests.fixtures.decoders import build_model


def test_import_writes_a_soma_directory_that_loads_the_same_model(tmp_path):
    hf_dir, soma_dir = tmp_path / "hf", tmp_path / "soma"
    _, tok = build_model("qwen3", str(hf_dir))
    (hf_dir / "generation_config.json").write_text(json.dumps({"temperature": 0.6, "top_p": 0.9, "do_sample": True}))
    r = subprocess.run([sys.executable, "-m", "soma_runtime.cli.main", "import", str(hf_dir), str(soma_dir)],
                       capture_output=True, text=True, timeout=120, check=False)
    assert r.returncode == 0, r.stderr
    config = tomllib.loads((soma_dir / "config.toml").read_text())
    assert config["model_type"] == "qwen3" and config["weights"]["files"] == ["weights.safetensors"]
    assert tomllib.loads((soma_dir / "chat.toml").read_text())["eos_token"] == "<|im_end|>"
    assert tomllib.loads((soma_dir / "sampling.toml").read_text()) == {"temperature": 0.6, "top_p": 0.9}

    soma, hf = Runtime().load(str(soma_dir), progress=False), Runtime().load(str(hf_dir), progress=False)
    ids = tok.encode("Hello world, this is a test.").ids
    np.testing.assert_array_equal(soma.logits(ids), hf.logits(ids))
    assert soma.loaded.format == "soma" and soma.request(ids).sampling.temperature == 0.6
    messages = [{"role": "user", "content": "hi"}]
    assert soma.chat_prompt(messages) == hf.chat_prompt(messages)
