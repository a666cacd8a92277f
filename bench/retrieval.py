"""The retrieval index (soma_runtime/context/index.py) on a generated folder of linked pages, with the bundled
MiniLM: the time to index N pages, one changed page's update, query latency p50/p99, and recall@5 of a
multi-hop question set with and without the graph signals (issue 57's targets at 10,000 pages on 2 cores:
indexing <= 10 min, an update <= 100 ms, p50 <= 20 ms).

The folder: people (each born in a town and working at an organisation, both linked), towns (each with its
river, and links to neighbouring towns), organisations (each with its founder) and notes linking at random;
frontmatter dates over two years. A question asks for the river of the town where a person was born: the
town's page never names the person, so only the person's link leads to it.
Run: python bench/retrieval.py [--pages 1000] [--questions 100]; JSON in bench/out/retrieval.json.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np

from soma_runtime.context.index import PageIndex, Weights
from soma_runtime.tasks import Runtime

OUT = Path(__file__).parent / "out"
SYLLABLES = ["ka", "lo", "mir", "ven", "tor", "sa", "bel", "dun", "ri", "ost", "an", "vel", "qui", "mar", "eth", "ul",
             "gor", "pen", "lis", "hal", "bro", "cen", "dra", "fen", "wy", "zel", "or", "tam", "nis", "kel"]
JOBS = ["glassblower", "violin maker", "ferryman", "archivist", "cartographer", "beekeeper", "stonemason", "weaver"]


def name(rng, used: set, words: int = 2) -> str:
    while True:
        text = " ".join("".join(rng.choice(SYLLABLES, rng.integers(2, 4))).capitalize() for _ in range(words))
        if text not in used:
            used.add(text)
            return text


def slug(text: str) -> str:
    return text.lower().replace(" ", "-")


def corpus(pages: int, seed: int = 0) -> tuple[dict[str, str], list[tuple[str, str]]]:
    """{relative path: text} and the multi-hop questions [(question, answer page)]."""
    rng, used = np.random.default_rng(seed), set()
    n_people, n_towns, n_orgs = int(pages * 0.4), int(pages * 0.2), int(pages * 0.2)
    n_notes = pages - n_people - n_towns - n_orgs
    towns = [name(rng, used, 1) for _ in range(n_towns)]
    orgs = [name(rng, used, 1) + " Guild" for _ in range(n_orgs)]
    people = [name(rng, used) for _ in range(n_people)]
    notes = [f"Note {i} on " + name(rng, used, 1) for i in range(n_notes)]
    all_titles = towns + orgs + people + notes

    def date():
        return f"2025-{rng.integers(1, 13):02d}-{rng.integers(1, 29):02d}" if rng.random() < 0.5 else \
            f"2026-{rng.integers(1, 12):02d}-{rng.integers(1, 29):02d}"
    out, born = {}, {}
    for town in towns:
        river = name(rng, used, 1)
        neighbours = " and ".join(f"[[{t}]]" for t in rng.choice(towns, 2, replace=False) if t != town)
        out[f"towns/{slug(town)}.md"] = (f"---\ntitle: {town}\ndate: {date()}\ntags: [town]\n---\n{town} is a town on the "
                                         f"river {river}, which runs through its market square. It trades with {neighbours}.")
    for org in orgs:
        founder = name(rng, used)
        out[f"orgs/{slug(org)}.md"] = (f"---\ntitle: {org}\ndate: {date()}\n---\nThe {org} was founded by {founder} and keeps "
                                       f"a workshop and a library for its members.")
    for person in people:
        town, org = rng.choice(towns), rng.choice(orgs)
        born[person] = town
        out[f"people/{slug(person)}.md"] = (f"---\ntitle: {person}\ndate: {date()}\ntags: [person]\n---\n{person} is a "
                                            f"{rng.choice(JOBS)}. Born in [[{town}]], {person.split()[0]} works at "
                                            f"[the guild](../orgs/{slug(org)}.md).")
    for note in notes:
        links = " ".join(f"[[{t}]]" for t in rng.choice(all_titles, 4, replace=False))
        out[f"notes/{slug(note)}.md"] = f"# {note}\nLoose notes from the archive, with pointers to {links}."
    asked = rng.choice(people, min(len(people), 100), replace=False)
    questions = [(f"Which river runs through the town where {p} was born?", f"towns/{slug(born[p])}.md") for p in asked]
    return out, questions


def percentile(values: list[float], q: float) -> float:
    return float(np.percentile(np.array(values), q))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pages", type=int, default=1000)
    parser.add_argument("--questions", type=int, default=100)
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args()
    pages, questions = corpus(args.pages)
    questions = questions[: args.questions]
    encoder = Runtime("cpu", threads=args.threads).load("minilm", progress=False)
    encoder.embed(["warm the encoder up"])
    with tempfile.TemporaryDirectory(prefix="soma-retrieval-") as root:
        for rel, text in pages.items():
            os.makedirs(os.path.join(root, os.path.dirname(rel)), exist_ok=True)
            with open(os.path.join(root, rel), "w", encoding="utf-8") as f:
                f.write(text)
        began = time.perf_counter()
        report = PageIndex(root, encoder).update()
        build_s = time.perf_counter() - began
        print(f"indexed {report.pages} pages, {report.links} links ({report.unresolved} unresolved) in {build_s:.1f} s "
              f"({report.pages / build_s:.1f} pages/s)", flush=True)
        index_bytes = os.path.getsize(os.path.join(root, ".soma-index.npz"))

        updates = []
        changed = next(rel for rel in pages if rel.startswith("people/"))
        for i in range(3):
            with open(os.path.join(root, changed), "a", encoding="utf-8") as f:
                f.write(f"\nAn added line, number {i}.")
            index = PageIndex(root, encoder)
            began = time.perf_counter()
            r = index.update()
            updates.append((time.perf_counter() - began) * 1e3)
            assert r.embedded == 1, r
        print(f"one page's update: {statistics.median(updates):.1f} ms median of {len(updates)} "
              f"(scan of {report.pages} files, read, embed, derive, write)", flush=True)

        index = PageIndex(root, encoder)
        for q, _ in questions:                        # the encoder plans each token length once: warm it first
            index.retrieve(q)
        latencies, found = [], {"graph": 0, "embedding only": 0}
        for q, answer in questions:
            began = time.perf_counter()
            hits = index.retrieve(q, top=5)
            latencies.append((time.perf_counter() - began) * 1e3)
            found["graph"] += answer in [h.page for h in hits]
            found["embedding only"] += answer in [h.page for h in index.retrieve(q, top=5, weights=Weights(1, 0, 0, 0))]
        recall = {k: v / len(questions) for k, v in found.items()}
        print(f"query latency: p50 {percentile(latencies, 50):.1f} ms, p99 {percentile(latencies, 99):.1f} ms "
              f"over {len(latencies)} queries (warm)")
        print(f"recall@5 on {len(questions)} multi-hop questions: graph signals {recall['graph']:.2f}, "
              f"embedding only {recall['embedding only']:.2f}")
    result = {"pages": report.pages, "links": report.links, "questions": len(questions), "index_seconds": build_s,
              "pages_per_second": report.pages / build_s, "index_bytes": index_bytes, "update_ms": updates,
              "update_ms_median": statistics.median(updates), "query_ms_p50": percentile(latencies, 50),
              "query_ms_p99": percentile(latencies, 99), "recall_at_5": recall, "weights": Weights().__dict__,
              "cpu_count": os.cpu_count(), "machine": platform.machine(), "threads": args.threads}
    OUT.mkdir(exist_ok=True)
    path = OUT / "retrieval.json"
    path.write_text(json.dumps(result, indent=2))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
