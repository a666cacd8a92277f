"""The command line, run as a user runs it (a subprocess through the installed entry point)."""
from __future__ import annotations

import json
import subprocess
import sys

from soma_runtime import __version__


def soma(*args):
    return subprocess.run([sys.executable, "-m", "soma_runtime.cli.main", *args], capture_output=True, text=True, timeout=120,
                          check=False)


def test_version():
    r = soma("--version")
    assert r.returncode == 0 and r.stdout.strip() == f"soma-runtime {__version__}"


def test_backends_lists_cpu_with_what_it_detected():
    r = soma("backends", "--json")
    assert r.returncode == 0, r.stderr
    report = json.loads(r.stdout)
    assert report["reference"]["available"] and report["cpu"]["available"]
    assert report["cpu"]["cores"] >= 1 and "numba" in report["cpu"]


def test_unknown_command_is_a_clear_error():
    r = soma("frobnicate")
    assert r.returncode == 2 and "invalid choice" in r.stderr


def test_autotune_times_the_default_models_shapes_and_caches_the_choices(tmp_path, monkeypatch):
    monkeypatch.setenv("SOMA_CACHE_DIR", str(tmp_path))
    r = soma("autotune", "--threads", "1")
    assert r.returncode == 0, r.stderr
    lines = r.stdout.strip().splitlines()
    assert lines[-1].startswith("4 shapes tuned for ") and lines[-1].endswith("/1t; table: " + str(tmp_path / "autotune.json"))
    table = json.loads((tmp_path / "autotune.json").read_text())
    (choices,) = table.values()
    assert len(choices) == 4 and set(choices.values()) <= {"int8", "blas", "amx"}


def test_models_info_lists_the_fusions_the_pass_found():
    """Per layer of the bundled llama: q/k/v stacked, gate and up interleaved in one gated product, two norms
    folded into products (and the head's), two residuals, keys and queries rotated where they are stored and
    read, one append for keys and values."""
    layers = json.loads(soma("models", "info").stdout)["layers"]
    r = soma("models", "info", "--fusions")
    assert r.returncode == 0, r.stderr
    found = {line.rsplit(None, 1)[0]: int(line.rsplit(None, 1)[1]) for line in r.stdout.strip().splitlines()}
    assert found == {"stack matmuls": layers, "norm->matmul": 2 * layers + 1, "matmul->residual": 2 * layers,
                     "gate/up+swiglu|geglu": layers, "rope->kv_append": layers, "rope->attention": layers,
                     "kv_append k+v": layers}


def test_run_holds_the_reply_to_a_schema_a_regex_or_a_grammar(tmp_path):
    import re

    import jsonschema
    schema = {"type": "object", "properties": {"tier": {"type": "integer", "minimum": 0, "maximum": 3}}, "required": ["tier"],
              "additionalProperties": False}
    (tmp_path / "schema.json").write_text(json.dumps(schema))
    (tmp_path / "yes.gbnf").write_text('root ::= " " ("yes" | "no")')
    r = soma("run", "--chat", "--prompt", "Pick a tier", "--json-schema", str(tmp_path / "schema.json"), "--seed", "1")
    assert r.returncode == 0, r.stderr
    jsonschema.validate(json.loads(r.stdout), schema)
    r = soma("run", "--prompt", "The year:", "--regex", " [0-9]{4}", "--seed", "2")
    assert r.returncode == 0 and re.fullmatch(r" [0-9]{4}\n", r.stdout), r.stderr
    r = soma("run", "--prompt", "Is it?", "--grammar", str(tmp_path / "yes.gbnf"))
    assert r.returncode == 0 and r.stdout in (" yes\n", " no\n"), r.stderr
    r = soma("run", "--prompt", "x", "--regex", "[a-")
    assert r.returncode != 0 and "invalid regex" in r.stderr


def test_run_takes_a_preset_and_the_repetition_penalty_with_its_options_over_them(smol):
    prompt = "The cat sat on the mat. The cat sat on the mat. The cat"
    r = soma("run", "--prompt", prompt, "--max-tokens", "16", "--preset", "creative", "--temperature", "0")
    assert r.returncode == 0, r.stderr
    assert r.stdout == smol.complete(prompt, max_tokens=16, temperature=0, repetition_penalty=1.2) + "\n"
    r = soma("run", "--prompt", prompt, "--max-tokens", "16", "--temperature", "0", "--repetition-penalty", "1.2",
             "--repeat-last-n", "0")
    assert r.returncode == 0 and r.stdout == smol.complete(prompt, max_tokens=16, temperature=0) + "\n", r.stderr
    r = soma("run", "--prompt", "x", "--preset", "fast")
    assert r.returncode == 1 and "preset must be one of router, code, reasoning, creative" in r.stderr


def test_context_commands_on_a_saved_session_file(smol, tmp_path):
    context = smol.context()
    context.set_system("You are terse.")
    for i in range(6):
        context.add_message("user", f"What is {i} plus {i}?")
        context.add_message("assistant", f"It is {2 * i}.")
    path = str(tmp_path / "session.json")
    context.save(path)
    r = soma("context", "show", "--file", path)
    assert r.returncode == 0 and r.stdout == context.show() + "\n", r.stderr
    r = soma("context", "blocks", "--file", path, "--json")
    assert r.returncode == 0 and json.loads(r.stdout) == context.report(), r.stderr
    r = soma("context", "budget", "history", "20", "--file", path)
    assert r.returncode == 0 and "history" in r.stdout and "cut" in r.stdout, r.stderr
    context.load(path)
    assert context.budgets["history"] == 20 and context.cuts[-1].reason == "budget"
    r = soma("context", "clear", "session", "--file", path)
    assert r.returncode == 1 and "history or all" in r.stderr


def test_context_commands_on_a_servers_session(server, tmp_path):
    status, _ = server.post("/v1/chat/completions", {"model": "default", "session": "cli", "max_tokens": 4, "temperature": 0,
                                                     "messages": [{"role": "user", "content": "Say hi."}]})
    assert status == 200
    tokens = server.post("/v1/context/tokens", {"session": "cli"})[1]
    r = soma("context", "tokens", "--session", "cli", "--url", server.url)
    assert r.returncode == 0 and r.stdout.startswith(f"total: {tokens['tokens']} / {tokens['window']}"), r.stderr
    saved = str(tmp_path / "cli.json")
    assert soma("context", "save", saved, "--session", "cli", "--url", server.url).returncode == 0
    r = soma("context", "load", saved, "--session", "cli-copy", "--url", server.url, "--json")
    assert r.returncode == 0 and json.loads(r.stdout)["tokens"] == tokens["tokens"], r.stderr
    r = soma("context", "show", "--session", "nobody", "--url", server.url)
    assert r.returncode == 1 and "404 session 'nobody' does not exist" in r.stderr
