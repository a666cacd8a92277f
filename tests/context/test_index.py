"""The retrieval index of a folder of linked pages, on corpora built here: links and frontmatter parsed and
resolved, PageRank and personalized PageRank equal to networkx's, each signal moving its page up, an
incremental update equal to a full rebuild, multi-hop questions answered through a link with the bundled
MiniLM where plain embedding search misses them, bad input skipped with its reason (nothing outside the
folder read), and the graph block of a Context filled from it within its budget."""
from __future__ import annotations

import hashlib
import os
import re
import shutil

import networkx as nx
import numpy as np
import pytest

from soma_runtime.context.index import (
    INDEX_FILE,
    MAX_LINKS,
    MAX_PAGE_BYTES,
    PageIndex,
    RetrievalError,
    Weights,
    pagerank,
    parse_frontmatter,
)

NOW = 1_800_000_000.0          # a fixed "now" (2027-01-15) for recency


class WordEncoder:
    """A deterministic stand-in encoder: hashed word counts, normalized (for tests of the ranking arithmetic)."""

    def __init__(self):
        self.texts = []

    def embed(self, texts):
        self.texts += texts
        out = np.zeros((len(texts), 256), np.float32)
        for i, text in enumerate(texts):
            for word in re.findall(r"[a-z0-9]+", text.lower()):
                out[i, int(hashlib.md5(word.encode()).hexdigest(), 16) % 256] += 1
        return out / np.maximum(np.linalg.norm(out, axis=1, keepdims=True), 1e-12)


class Counting:
    """An encoder wrapper that records what it embedded."""

    def __init__(self, encoder):
        self.encoder, self.texts = encoder, []

    def embed(self, texts):
        self.texts += list(texts)
        return self.encoder.embed(texts)


def write(root, pages: dict[str, str]) -> str:
    for rel, text in pages.items():
        path = os.path.join(root, rel)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "w", encoding="utf-8") as f:
            f.write(text)
    return str(root)


def edges(index: PageIndex) -> set[tuple[str, str]]:
    return {(index.pages[a].path, index.pages[b].path) for a, b in zip(index.src, index.dst)}


def rank_of(hits, page: str) -> int:
    return [h.page for h in hits].index(page)


# --- parsing -------------------------------------------------------------------------------------

def test_frontmatter_reads_values_inline_lists_and_item_lists():
    meta, body = parse_frontmatter("---\ntitle: \"Ada Quill\"\naliases: [Ada, A. Quill]\ndate: 2026-11-01\n"
                                   "tags:\n  - people\n  - glass\n---\n# Body\ntext")
    assert meta == {"title": "Ada Quill", "aliases": ["Ada", "A. Quill"], "date": "2026-11-01", "tags": ["people", "glass"]}
    assert body == "# Body\ntext"
    assert parse_frontmatter("---\ntitle: never closed\nbody") == ({}, "---\ntitle: never closed\nbody")


def test_wiki_and_markdown_links_resolve_by_path_name_title_and_alias(tmp_path):
    root = write(tmp_path, {
        "a.md": "# A\n[[Bee Title]] [[cee-alias|shown]] [[d#Some heading]] [[sub/e]] [e again](sub/e.md) "
                "[web](https://example.com/x.md) [[missing page]] [[a]] ![[f]]\n```\n[[d]] [[g]]\n```\n",
        "b.md": "---\ntitle: Bee Title\n---\nbee",
        "c.md": "---\naliases:\n  - Cee-Alias\n---\ncee",
        "d.md": "# Dee\n## Some heading\n[up](../a.md) [back](a.md)",
        "sub/e.md": "# E\n[[A]]",
        "f.md": "f",
        "g.md": "g",
    })
    index = PageIndex(root, WordEncoder())
    report = index.update()
    assert edges(index) == {("a.md", "b.md"), ("a.md", "c.md"), ("a.md", "d.md"), ("a.md", "sub/e.md"), ("a.md", "f.md"),
                            ("d.md", "a.md"), ("sub/e.md", "a.md")}
    assert report.unresolved == 1 and report.links == 7           # [[missing page]]; self-links and code aside
    assert index.pages[index.by_path["b.md"]].title == "Bee Title"
    assert index.pages[index.by_path["d.md"]].title == "Dee"
    assert index.pages[index.by_path["f.md"]].title == "f"


# --- PageRank ------------------------------------------------------------------------------------

def test_pagerank_and_personalized_pagerank_equal_networkx():
    rng = np.random.default_rng(0)
    n = 60
    pairs = {(int(a), int(b)) for a, b in rng.integers(0, n, (180, 2)) if a != b and a < 50}     # 50..59 dangling
    src, dst = (np.array(x, dtype=np.int64) for x in zip(*sorted(pairs)))
    graph = nx.DiGraph()
    graph.add_nodes_from(range(n))
    graph.add_edges_from(pairs)
    seeds = {3: 0.7, 17: 0.2, 55: 0.1}
    weights = np.zeros(n)
    weights[list(seeds)] = list(seeds.values())
    for personalization, mine in ((None, pagerank(n, src, dst)), (seeds, pagerank(n, src, dst, weights))):
        theirs = nx.pagerank(graph, alpha=0.85, personalization=personalization)
        assert np.abs(mine - np.array([theirs[i] for i in range(n)])).max() < 1e-6


def test_the_index_ranks_its_own_link_graph_as_networkx_does(tmp_path):
    pages = {f"p{i}.md": f"# P{i}\n" + " ".join(f"[[P{j}]]" for j in range(i + 1, i + 4) if j < 12) for i in range(12)}
    pages["p11.md"] += " [[P0]]"                                  # a cycle back to the start
    pages["loner.md"] = "# Loner\nno links"
    index = PageIndex(write(tmp_path, pages), WordEncoder())
    index.update()
    graph = nx.DiGraph()
    graph.add_nodes_from(range(len(index.pages)))
    graph.add_edges_from(zip(index.src.tolist(), index.dst.tolist()))
    theirs = nx.pagerank(graph, alpha=0.85)
    assert np.abs(index.gravity - np.array([theirs[i] for i in range(len(index.pages))])).max() < 1e-6


# --- each signal moves its page up ---------------------------------------------------------------

SIGNAL_PAGES = {
    "x.md": "---\ndate: 2020-01-01\n---\n# X\napple orchard harvest notes",
    "y.md": "---\ndate: 2020-01-01\n---\n# Y\napple orchard harvest notes and cider",
    "seed.md": "---\ndate: 2020-01-01\n---\n# Seed\napple orchard harvest notes cider press [[Y]]",
    **{f"fan{i}.md": f"---\ndate: 2020-01-01\n---\n# Fan {i}\nunrelated walls {i} [[Y]]" for i in range(6)},
}


@pytest.fixture
def signal_index(tmp_path):
    index = PageIndex(write(tmp_path, SIGNAL_PAGES), WordEncoder())
    index.update()
    return index


def test_turning_up_gravity_moves_the_much_linked_page_up(signal_index):
    query = "apple orchard harvest notes"
    assert rank_of(signal_index.retrieve(query, 9, Weights(1, 0, 0, 0), now=NOW), "y.md") > \
        rank_of(signal_index.retrieve(query, 9, Weights(1, 0, 0, 0), now=NOW), "x.md")
    assert rank_of(signal_index.retrieve(query, 9, Weights(1, 0, 3, 0), now=NOW), "y.md") < \
        rank_of(signal_index.retrieve(query, 9, Weights(1, 0, 3, 0), now=NOW), "x.md")


def test_turning_up_proximity_moves_the_linked_page_up(signal_index):
    query = "apple orchard harvest notes press"
    plain = signal_index.retrieve(query, 9, Weights(1, 0, 0, 0), now=NOW, seeds=1)
    linked = signal_index.retrieve(query, 9, Weights(1, 2, 0, 0), now=NOW, seeds=1)
    assert plain[0].page == linked[0].page == "seed.md"
    assert rank_of(linked, "y.md") < rank_of(plain, "y.md")
    assert linked[rank_of(linked, "y.md")].signals["proximity"]["share"] > 0


def test_turning_up_recency_moves_the_newer_page_up(tmp_path):
    pages = dict(SIGNAL_PAGES)
    pages["y.md"] = pages["y.md"].replace("date: 2020-01-01", "date: 2027-01-01")
    index = PageIndex(write(tmp_path, pages), WordEncoder())
    index.update()
    query = "apple orchard harvest notes"
    assert rank_of(index.retrieve(query, 9, Weights(1, 0, 0, 0), now=NOW), "y.md") > 0
    hits = index.retrieve(query, 9, Weights(1, 0, 0, 3), now=NOW)
    assert hits[0].page == "y.md" and hits[0].signals["recency"]["raw"] > 0.5 > hits[1].signals["recency"]["raw"]


def test_turning_up_similarity_moves_the_most_similar_page_up(signal_index):
    query = "apple orchard harvest notes"
    most_similar = signal_index.retrieve(query, 1, Weights(1, 0, 0, 0), now=NOW)[0].page
    assert most_similar != "y.md"
    assert signal_index.retrieve(query, 9, Weights(0.2, 0, 1, 0), now=NOW)[0].page == "y.md"     # gravity wins
    assert signal_index.retrieve(query, 9, Weights(10, 0, 1, 0), now=NOW)[0].page == most_similar


def test_shares_add_up_to_the_score(signal_index):
    hits = signal_index.retrieve("apple cider", 9, now=NOW)
    assert hits[0].score > 0 and hits[-1].score == 0                  # the last: the lowest on every signal
    for hit in hits:
        assert sum(s["share"] for s in hit.signals.values()) == pytest.approx(1.0 if hit.score > 0 else 0.0)
        assert all(0 <= s["normalized"] <= 1 for s in hit.signals.values())


# --- with the bundled MiniLM -----------------------------------------------------------------------

@pytest.fixture(scope="module")
def minilm():
    from soma_runtime.tasks import Runtime
    return Runtime("cpu").load("minilm", progress=False)


CORPUS = {
    "people/ada-quill.md": "---\ntitle: Ada Quill\naliases: [Ada]\ndate: 2026-11-01\ntags:\n  - people\n---\n"
                           "Ada Quill is a glassblower. She was born in [[Varnholt]] and learned her craft there before "
                           "moving to the capital.",
    "places/varnholt.md": "# Varnholt\nA harbour settlement on the northern coast, known for herring boats and a stone "
                          "lighthouse. Council elder: Oren Tash.",
    "people/bram-okafor.md": "# Bram Okafor\nBram Okafor is a violin maker who trained at "
                             "[the conservatory](../schools/saltmarsh.md) for six years.",
    "schools/saltmarsh.md": "---\ntitle: Saltmarsh Conservatory\n---\nA conservatory on the estuary, established by Lena "
                            "Voss in 1902, with workshops for string instruments.",
    "people/cora-lind.md": "# Cora Lind\nCora Lind is a novelist. Her best-known book is [[The Glass Orchard|her first novel]].",
    "books/the-glass-orchard.md": "# The Glass Orchard\nA 1987 story of two sisters and an orchard in winter; printed by "
                                  "Heron Press in a run of 3,000 copies.",
}
for _town in ("Dunmere", "Brackwater", "Elsford", "Greyhollow", "Kettering Vale", "Ashby Cross", "Pellmoor"):
    CORPUS[f"places/{_town.lower().replace(' ', '-')}.md"] = \
        f"# {_town}\n{_town} is a small town. The mayor of {_town} was born in the town and has led it for ten years."
for _school in ("Northgate Academy", "Riverside School of Music", "Halden College", "Ember Institute", "Westfield Academy",
                "Copperline School"):
    CORPUS[f"schools/{_school.lower().replace(' ', '-')}.md"] = \
        f"# {_school}\n{_school} is a school where many students trained. It was founded by its first headmaster."
for _press in ("Marlow Books", "Tidewater Press", "Lantern House", "Oakleaf Publishing", "Greystone Press", "Bluebird Editions"):
    CORPUS[f"publishers/{_press.lower().replace(' ', '-')}.md"] = \
        f"# {_press}\n{_press} is a publisher that printed many novels by new writers."
MULTI_HOP = [("Who is the mayor of the town where Ada Quill was born?", "places/varnholt.md"),
             ("Who founded the school where Bram Okafor trained?", "schools/saltmarsh.md"),
             ("Which publisher printed the novel written by Cora Lind?", "books/the-glass-orchard.md")]


def test_multi_hop_answers_reachable_only_through_a_link_are_found_with_graph_signals(tmp_path, minilm):
    index = PageIndex(write(tmp_path, CORPUS), minilm)
    index.update()
    for question, answer in MULTI_HOP:
        plain = [h.page for h in index.retrieve(question, 5, Weights(1, 0, 0, 0), now=NOW)]
        graph = [h.page for h in index.retrieve(question, 5, now=NOW)]
        linked_only = [h.page for h in index.retrieve(question, 5, Weights(0.5, 0.5, 0, 0), now=NOW)]
        assert answer not in plain, (question, plain)
        assert answer in graph, (question, graph)
        assert answer in linked_only, (question, linked_only)       # proximity alone carries it, not gravity


def test_an_incremental_update_equals_a_full_rebuild(tmp_path, minilm):
    live = write(tmp_path / "live", CORPUS)
    encoder = Counting(minilm)
    index = PageIndex(live, encoder)
    assert index.update().embedded == len(CORPUS)
    os.utime(os.path.join(live, "places/dunmere.md"))               # touched, same text: read again, not embedded
    with open(os.path.join(live, "places/varnholt.md"), "a") as f:
        f.write("\nIts sister town is [[Elsford]].")
    write(live, {"places/new-town.md": "# New Town\nBuilt in 2026 beside [[Varnholt]]."})
    os.remove(os.path.join(live, "publishers/marlow-books.md"))
    encoder.texts.clear()
    report = PageIndex(live, encoder).update()
    assert (report.embedded, report.removed, report.pages) == (2, 1, len(CORPUS))
    assert [t.split("\n")[0] for t in encoder.texts] == ["New Town", "Varnholt"]
    updated = PageIndex(live, minilm)
    assert ("places/varnholt.md", "places/elsford.md") in edges(updated)
    copy = str(tmp_path / "copy")
    shutil.copytree(live, copy, ignore=shutil.ignore_patterns(INDEX_FILE))       # copy2: the same mtimes
    rebuilt = PageIndex(copy, minilm)
    rebuilt.update()
    assert [p.path for p in updated.pages] == [p.path for p in rebuilt.pages]
    assert edges(updated) == edges(rebuilt) and np.array_equal(updated.gravity, rebuilt.gravity)
    assert np.abs(updated.vectors - rebuilt.vectors).max() < 1e-5
    for question, _ in MULTI_HOP + [("a town built beside Varnholt", None)]:
        a, b = updated.retrieve(question, 8, now=NOW), rebuilt.retrieve(question, 8, now=NOW)
        assert [h.page for h in a] == [h.page for h in b]
        assert np.allclose([h.score for h in a], [h.score for h in b], atol=1e-5)


# --- bad input -----------------------------------------------------------------------------------

def test_link_cycles_are_ordinary(tmp_path):
    index = PageIndex(write(tmp_path, {"a.md": "[[b]]", "b.md": "[[c]]", "c.md": "[[a]] [[b]]"}), WordEncoder())
    index.update()
    assert len(index.src) == 4 and index.gravity.sum() == pytest.approx(1.0)
    assert {h.page for h in index.retrieve("a", 3, now=NOW)} == {"a.md", "b.md", "c.md"}


def test_100000_links_on_one_page_are_capped_and_reported(tmp_path):
    hub = "# Hub\n" + " ".join(f"[[p{i}]]" for i in range(100_000))
    index = PageIndex(write(tmp_path, {"hub.md": hub, "p0.md": "zero", "p5.md": "five"}), WordEncoder())
    report = index.update()
    assert report.capped == [{"path": "hub.md", "links": 100_000, "kept": MAX_LINKS}]
    assert edges(index) == {("hub.md", "p0.md"), ("hub.md", "p5.md")} and report.unresolved == MAX_LINKS - 2


def test_binary_non_utf8_oversized_and_symlinked_files_are_skipped_with_reasons(tmp_path, monkeypatch):
    outside = tmp_path / "outside"
    write(outside, {"secret.md": "# Secret\nthe vault code is 1234"})
    root = tmp_path / "pages"
    write(root, {"ok.md": "# Ok\nfine [[secret]]"})
    (root / "binary.md").write_bytes(b"# Bin\x00\x01\x02")
    (root / "latin1.md").write_bytes("# Café\n".encode("latin-1"))
    (root / "image.png").write_bytes(b"\x89PNG\r\n\x1a\n\x00")
    with open(root / "huge.md", "wb") as f:
        f.truncate(50 * 2**20)                                  # 50 MB: refused by its size, never read
    (root / "leak.md").symlink_to(outside / "secret.md")
    (root / "linked-dir").symlink_to(outside, target_is_directory=True)
    (root / "inner.md").symlink_to(root / "ok.md")
    opened = []
    real_open = os.open
    monkeypatch.setattr(os, "open", lambda path, *a, **k: opened.append(os.path.realpath(path)) or real_open(path, *a, **k))
    index = PageIndex(str(root), WordEncoder())
    report = index.update()
    monkeypatch.undo()
    reasons = {s.path: s.reason for s in report.skips}
    assert reasons == {"binary.md": "binary (a NUL byte at offset 5)", "latin1.md": "not UTF-8 (byte 5)",
                       "huge.md": f"{50 * 2**20} bytes, over the {MAX_PAGE_BYTES}-byte page limit",
                       "leak.md": "a symlink, not followed (it points outside the folder)",
                       "linked-dir": "a symlink, not followed (it points outside the folder)",
                       "inner.md": "a symlink, not followed"}
    assert [p.path for p in index.pages] == ["ok.md"] and report.ignored == 1 and report.unresolved == 1
    assert opened and all(p.startswith(str(root.resolve()) + os.sep) for p in opened)
    assert "huge.md" not in {os.path.basename(p) for p in opened}
    assert PageIndex(str(root), None).report()["skips"] == [{"path": p, "reason": r} for p, r in sorted(reasons.items())]


def test_bad_queries_and_a_corrupt_index_file_are_clear_errors(tmp_path):
    index = PageIndex(write(tmp_path, {"a.md": "a"}), WordEncoder())
    index.update()
    with pytest.raises(RetrievalError, match="non-empty text"):
        index.retrieve("  ")
    with pytest.raises(RetrievalError, match="top must be an integer >= 1"):
        index.retrieve("a", top=0)
    with pytest.raises(RetrievalError, match="weights must be finite numbers >= 0"):
        Weights(1, -1, 0, 0)
    (tmp_path / INDEX_FILE).write_bytes(b"not an npz")
    with pytest.raises(RetrievalError, match="not a readable index"):
        PageIndex(str(tmp_path), WordEncoder())
    with pytest.raises(RetrievalError, match="not a directory"):
        PageIndex(str(tmp_path / "a.md"), WordEncoder())


# --- the graph block -----------------------------------------------------------------------------

def test_inject_graph_packs_the_top_pages_as_structured_content_and_records_a_cut(tmp_path, smol):
    index = PageIndex(write(tmp_path, SIGNAL_PAGES), WordEncoder())
    index.update()
    context = smol.context()
    context.set_system("Answer from the pages.")
    hits = context.inject_graph("apple orchard harvest notes cider press", index, top=3)
    assert [h["kept"] for h in hits] == [True, True, True]
    shown = context.show()
    first = shown.index(f"## page: {hits[0]['page']}")
    assert first < shown.index(f"## page: {hits[1]['page']}") < shown.index(f"## page: {hits[2]['page']}")
    assert "---\ntitle: Seed\ndate: 2020-01-01\n---\n# Seed\napple orchard harvest notes cider press [[Y]]\nlinks: y.md" in shown
    graph = next(b for b in context.blocks() if b["block"] == "graph")
    context.set_budget("graph", graph["tokens"] - 1)              # one token short: the least relevant page goes
    assert [c.block for c in context.cuts] == ["graph"] and context.cuts[0].reason == "budget"
    assert f"## page: {hits[2]['page']}" not in context.show() and "1 pages" in context.show()
    again = context.inject_graph("apple orchard harvest notes cider press", index, top=3)
    assert [h["kept"] for h in again] == [True, True, False]
