"""`soma-runtime detect` as a user runs it: an ultralytics YOLO11n export on photos, printed as text and as JSON
lines (the library's detections), boxes drawn with --out (a file for one image, a directory for several); a text
file given as an image, a model that is not a detector and a file given as --out for several images are
one-line errors."""
from __future__ import annotations

import json

import numpy as np
import PIL.Image
import pytest

from soma_runtime.tasks import Runtime
from tests.cli.test_cli import soma
from tests.fixtures.vision_exports import vision_exports


@pytest.fixture(scope="module")
def made() -> dict:
    found = vision_exports()
    return {"model": found["models"]["yolo11n.onnx"]["path"], "photos": found["predictions"]["paths"][:2],
            "graph": found["models"]["resnet18-torchscript.onnx"]["path"]}


def test_json_lines_are_the_librarys_detections_and_text_names_each(made):
    done = soma("detect", "--model", made["model"], "--image", *made["photos"], "--json", "--backend", "cpu")
    assert done.returncode == 0, done.stderr
    lines = [json.loads(line) for line in done.stdout.splitlines()]
    want = Runtime("cpu").load(made["model"], progress=False).detect(made["photos"])
    assert [line["image"] for line in lines] == made["photos"]
    assert [line["detections"] for line in lines] == [[d.to_dict() for d in found] for found in want]
    text = soma("detect", "--model", made["model"], "--image", made["photos"][0], "--conf", "0.27", "--backend", "cpu")
    assert text.returncode == 0, text.stderr
    head, *rows = text.stdout.splitlines()
    kept = [d for d in want[0] if d.confidence > 0.27]
    assert head == f"{made['photos'][0]}: {len(kept)} detections" and len(rows) == len(kept)
    assert rows[0] == f"  {kept[0].label} {kept[0].confidence:.3f} [{', '.join(f'{v:.1f}' for v in kept[0].box)}]"


def test_out_draws_the_boxes_on_one_image_or_into_a_directory_for_several(made, tmp_path):
    one = tmp_path / "annotated.jpg"
    done = soma("detect", "--model", made["model"], "--image", made["photos"][0], "--out", str(one), "--backend", "cpu")
    assert done.returncode == 0, done.stderr
    drawn, original = np.asarray(PIL.Image.open(one)), np.asarray(PIL.Image.open(made["photos"][0]))
    assert drawn.shape == original.shape and np.abs(drawn.astype(int) - original).max() > 100   # boxes drawn
    folder = tmp_path / "drawn"
    done = soma("detect", "--model", made["model"], "--image", *made["photos"], "--out", str(folder), "--backend", "cpu")
    assert done.returncode == 0, done.stderr
    assert sorted(p.name for p in folder.iterdir()) == sorted(p.rsplit("/", 1)[1] for p in made["photos"])


def test_bad_input_is_a_one_line_error(made, tmp_path):
    text = tmp_path / "notes.jpg"
    text.write_text("a shopping list, not a photo")
    done = soma("detect", "--model", made["model"], "--image", str(text), "--backend", "cpu")
    assert done.returncode == 1 and done.stderr.startswith("soma-runtime: error:") and "notes.jpg" in done.stderr
    assert len(done.stderr.strip().splitlines()) == 1
    graph = soma("detect", "--model", made["graph"], "--image", made["photos"][0], "--backend", "cpu")
    assert graph.returncode == 1 and "is a graph model; detect needs an object detector" in graph.stderr
    several = soma("detect", "--model", made["model"], "--image", *made["photos"], "--out", str(text), "--backend", "cpu")
    assert several.returncode == 1 and "with several images --out names a directory" in several.stderr
    bad = soma("detect", "--model", made["model"], "--image", made["photos"][0], "--conf", "7", "--backend", "cpu")
    assert bad.returncode == 1 and "conf must be a number in [0, 1]" in bad.stderr


def test_run_still_runs_a_detector_as_the_graph_it_is(made, tmp_path):
    x = tmp_path / "x.npy"
    np.save(x, np.random.default_rng(0).random((1, 3, 256, 320), np.float32))
    done = soma("run", "--model", made["model"], "--input", f"images={x}", "--output-dir", str(tmp_path / "out"),
                "--backend", "cpu")
    assert done.returncode == 0, done.stderr
    assert np.load(tmp_path / "out" / "output0.npy").shape == (1, 84, 1680)
