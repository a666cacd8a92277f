"""POST /v1/retrieve on a server started with `--retrieval-dir NAME=DIR`: the pages `soma-runtime retrieve
--json` gives, for the served folder by name or path only (403 for any other), bad bodies 400, the index
file followed when it changes, and a folder without an index refused before the server starts."""
from __future__ import annotations

import os

import pytest

from soma_runtime.context.index import PageIndex
from tests.cli.test_cli import soma
from tests.context.test_index import CORPUS, MULTI_HOP, write
from tests.server.conftest import ServerProcess


@pytest.fixture(scope="module")
def minilm():
    from soma_runtime.tasks import Runtime
    return Runtime("cpu").load("minilm", progress=False)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory, minilm):
    root = write(tmp_path_factory.mktemp("corpus"), CORPUS)
    PageIndex(root, minilm).update()
    return root


@pytest.fixture(scope="module")
def served(corpus):
    s = ServerProcess("--retrieval-dir", f"corpus={corpus}")
    yield s
    assert s.stop() == 0, s.output()


def test_retrieve_answers_the_ranked_pages_by_name_or_path(served, corpus, minilm):
    question, answer = MULTI_HOP[1]
    status, hits = served.post("/v1/retrieve", {"index": "corpus", "query": question, "top": 5})
    assert status == 200, hits
    expected = PageIndex(corpus, minilm).retrieve(question, top=5)
    assert [h["page"] for h in hits] == [h.page for h in expected] and answer in [h["page"] for h in hits]
    assert [h["score"] for h in hits] == pytest.approx([h.score for h in expected], abs=1e-4)
    assert all(set(h) == {"page", "score", "signals"} for h in hits)
    status, by_path = served.post("/v1/retrieve", {"index": corpus, "query": question, "top": 5})
    assert status == 200 and [h["page"] for h in by_path] == [h["page"] for h in hits]


def test_folders_the_server_was_not_told_to_serve_are_refused(served, corpus, tmp_path):
    for other in (str(tmp_path), "/etc", os.path.join(corpus, ".."), os.path.join(corpus, "people"), "elsewhere"):
        status, body = served.post("/v1/retrieve", {"index": other, "query": "q"})
        assert status == 403, (other, body)
        assert body["error"]["message"] == "index must name a folder this server serves (corpus)"


def test_bad_retrieve_bodies_are_400s(served):
    for body, words in (({"index": "corpus", "query": "q", "top": 0}, "top"), ({"index": "corpus", "query": ""}, "query"),
                        ({"index": "corpus", "query": "q", "top": 101}, "top"), ({"index": "corpus"}, "query"),
                        ({"index": "corpus", "query": "q", "weights": [1]}, "unknown field")):
        status, answer = served.post("/v1/retrieve", body)
        assert status == 400 and words in answer["error"]["message"], (body, answer)


def test_the_server_follows_its_index_file_when_it_changes(served, corpus, minilm):
    question = "Which town is the sister town of Varnholt?"
    with open(os.path.join(corpus, "places/varnholt.md"), "a") as f:
        f.write("\nIts sister town is [[Elsford]].")
    PageIndex(corpus, minilm).update()
    status, hits = served.post("/v1/retrieve", {"index": "corpus", "query": question, "top": 3})
    assert status == 200, hits
    assert [h["page"] for h in hits] == [h.page for h in PageIndex(corpus, minilm).retrieve(question, top=3)]
    assert hits[0]["page"] == "places/varnholt.md" and "places/elsford.md" in [h["page"] for h in hits]


def test_a_folder_without_an_index_is_refused_before_the_server_starts(tmp_path):
    r = soma("serve", "--retrieval-dir", str(tmp_path), "--port", "0")
    assert r.returncode == 1 and f"no .soma-index.npz there; build it with `soma-runtime index {tmp_path}`" in r.stderr
