"""`soma-runtime index DIR` and `soma-runtime retrieve DIR QUERY`, run as a user runs them (subprocesses, the
bundled MiniLM), on the linked corpus of tests/context/test_index.py."""
from __future__ import annotations

import json
import os

from tests.cli.test_cli import soma
from tests.context.test_index import CORPUS, MULTI_HOP, write


def test_index_prints_counts_and_skips_then_updates_only_what_changed(tmp_path):
    root = write(tmp_path, CORPUS)
    (tmp_path / "binary.md").write_bytes(b"\x00\x01")
    r = soma("index", root)
    assert r.returncode == 0, r.stderr
    lines = r.stdout.strip().splitlines()
    assert lines[0].startswith(f"{len(CORPUS)} pages ({len(CORPUS)} embedded, 0 unchanged, 0 removed), 3 links (0 unresolved)")
    assert lines[0].endswith(f"index: {os.path.realpath(root)}/.soma-index.npz")
    assert lines[1:] == ["skipped binary.md: binary (a NUL byte at offset 0)"]
    with open(tmp_path / "people/cora-lind.md", "a") as f:
        f.write(" She lives in [[Varnholt]].")
    r = soma("index", root, "--json")
    assert r.returncode == 0, r.stderr
    report = json.loads(r.stdout)
    assert (report["embedded"], report["unchanged"], report["links"]) == (1, len(CORPUS) - 1, 4)


def test_retrieve_ranks_pages_with_each_signals_share(tmp_path):
    root = write(tmp_path, CORPUS)
    question, answer = MULTI_HOP[0]
    r = soma("retrieve", root, question, "--top", "5", "--json")
    assert r.returncode == 0, r.stderr
    hits = json.loads(r.stdout)
    assert len(hits) == 5 and answer in [h["page"] for h in hits]
    assert all(set(h) == {"page", "score", "signals"} for h in hits)
    assert set(hits[0]["signals"]) == {"similarity", "proximity", "gravity", "recency"}
    assert [h["score"] for h in hits] == sorted((h["score"] for h in hits), reverse=True)
    r = soma("retrieve", root, question, "--top", "5", "--weights", "1,0,0,0")
    assert r.returncode == 0, r.stderr
    rows = r.stdout.strip().splitlines()
    assert len(rows) == 5 and answer not in r.stdout and "similarity 100%" in rows[0]


def test_retrieve_refuses_a_missing_folder_and_bad_weights(tmp_path):
    r = soma("retrieve", str(tmp_path / "nowhere"), "q")
    assert r.returncode == 1 and "not a directory" in r.stderr
    r = soma("retrieve", str(tmp_path), "q", "--weights", "1,2")
    assert r.returncode == 1 and "--weights takes 4 numbers" in r.stderr
