"""`soma-runtime classify --image` as a user runs it (a subprocess of its own): a tiny ViT directory on photos,
printed as text and as JSON lines (the library's labels); a text file given as an image, a model that is not an
image classifier and a bad --top-k are one-line errors."""
from __future__ import annotations

import json

import PIL.Image
import pytest

from soma_runtime.tasks import Runtime
from tests.cli.test_cli import soma
from tests.fixtures import encoders
from tests.fixtures.vit import build, photos


@pytest.fixture(scope="module")
def made(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("classify")
    build(root / "vit")
    paths = []
    for name, pixels in list(photos().items())[:2]:
        paths.append(str(root / f"{name}.png"))
        PIL.Image.fromarray(pixels).save(paths[-1])
    encoders.build("bert", "sequence", root / "bert")
    return {"model": str(root / "vit"), "photos": paths, "text_model": str(root / "bert"), "root": root}


def test_json_lines_are_the_librarys_labels_and_text_names_each(made):
    done = soma("classify", "--model", made["model"], "--image", *made["photos"], "--json", "--top-k", "3",
                "--backend", "cpu")
    assert done.returncode == 0, done.stderr
    lines = [json.loads(line) for line in done.stdout.splitlines()]
    want = Runtime("cpu").load(made["model"], progress=False).classify_image(made["photos"], top_k=3)
    assert [line["image"] for line in lines] == made["photos"]
    assert [line["labels"] for line in lines] == [[{"label": lab, "score": s} for lab, s in found] for found in want]
    text = soma("classify", "--model", made["model"], "--image", made["photos"][0], "--backend", "cpu")
    assert text.returncode == 0, text.stderr
    head, *rows = text.stdout.splitlines()
    assert head == made["photos"][0] and len(rows) == 5
    label, score = want[0][0]
    assert rows[0] == f"  {label} {score:.4f}"


@pytest.mark.parametrize("case, needle", [("text-as-image", "not an image"), ("text-model", "runs the encode task"),
                                          ("top-k", "top_k must be an integer in")])
def test_errors_are_one_line(made, case, needle):
    model, image, extra = made["model"], made["photos"][0], []
    if case == "text-as-image":
        image = str(made["root"] / "notes.jpg")
        with open(image, "w") as f:
            f.write("not a picture at all")
    elif case == "text-model":
        model = made["text_model"]
    else:
        extra = ["--top-k", "0"]
    done = soma("classify", "--model", model, "--image", image, *extra, "--backend", "cpu")
    assert done.returncode != 0 and needle in done.stderr, done.stderr
    assert len(done.stderr.strip().splitlines()) == 1 and "Traceback" not in done.stderr
