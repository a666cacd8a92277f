"""The `index` and `retrieve` commands (issue 57, graph retrieval): build or update a folder's page index
with an encoder this runtime runs, and rank its pages for a query with each signal's share."""
from __future__ import annotations

import json
import logging
import os

from soma_runtime.errors import RequestError

log = logging.getLogger("soma_runtime")


def add_parsers(sub, positive_int) -> None:
    ix = sub.add_parser("index", help="build or update the retrieval index of a folder of markdown pages")
    ix.add_argument("directory", metavar="DIR", help="the folder of pages (its index: DIR/.soma-index.npz)")
    ix.add_argument("--model", "-m", default=None,
                    help="the encoder that embeds the pages (default: the one the index was built with, else the bundled "
                         "MiniLM, 'minilm'); another model than the index's embeds every page again")
    ix.add_argument("--threads", type=positive_int, default=None, help="CPU threads (default: the physical cores)")
    ix.add_argument("--json", action="store_true", help="print the update's report as JSON")
    ix.set_defaults(run=cmd_index)

    rt = sub.add_parser("retrieve", help="rank a folder's pages for a query (its index updated first)")
    rt.add_argument("directory", metavar="DIR", help="the folder of pages")
    rt.add_argument("query", help="the query text")
    rt.add_argument("--top", "-k", type=positive_int, default=5, help="how many pages (default: 5)")
    rt.add_argument("--weights", default=None, metavar="A,B,G,D",
                    help="similarity, proximity, gravity and recency weights (default: 0.3,0.5,0.1,0.1)")
    rt.add_argument("--model", "-m", default=None, help="the encoder (default: the one the index was built with)")
    rt.add_argument("--threads", type=positive_int, default=None, help="CPU threads (default: the physical cores)")
    rt.add_argument("--json", action="store_true",
                    help='print a JSON list of {"page": relative path, "score", "signals": {signal: {raw, normalized, share}}}')
    rt.set_defaults(run=cmd_retrieve)


def open_index(args):
    from soma_runtime.context.index import PageIndex, RetrievalError, recorded_model
    from soma_runtime.tasks import Runtime
    if not os.path.isdir(args.directory):
        raise RetrievalError(f"{args.directory}: not a directory")
    model = args.model or recorded_model(args.directory) or "minilm"
    encoder = Runtime(threads=args.threads).load(model, progress=False)
    if encoder.task != "encode":
        raise RequestError(f"{model} is not an encoder (it runs the {encoder.task} task); give one with --model")
    return PageIndex(args.directory, encoder, model=model)


def cmd_index(args) -> int:
    index = open_index(args)
    report = index.update()
    if args.json:
        print(json.dumps(report.to_json(), indent=2))
        return 0
    print(f"{report.pages} pages ({report.embedded} embedded, {report.unchanged} unchanged, {report.removed} removed), "
          f"{report.links} links ({report.unresolved} unresolved), {report.ignored} other files ignored, "
          f"{len(report.skips)} skipped, in {report.seconds:.1f} s; index: {index.path}")
    for skip in report.skips:
        print(f"skipped {skip.path}: {skip.reason}")
    for cap in report.capped:
        print(f"capped {cap['path']}: {cap['links']} links, the first {cap['kept']} kept")
    return 0


def cmd_retrieve(args) -> int:
    from soma_runtime.context.index import SIGNALS, Weights
    weights = None
    if args.weights is not None:
        try:
            values = [float(v) for v in args.weights.split(",")]
        except ValueError:
            values = []
        if len(values) != len(SIGNALS):
            raise RequestError(f"--weights takes {len(SIGNALS)} numbers ({','.join(SIGNALS)}), got {args.weights!r}")
        weights = Weights(*values)
    index = open_index(args)
    report = index.update()
    if report.embedded or report.removed:
        log.info("index updated: %d pages embedded, %d removed", report.embedded, report.removed)
    hits = index.retrieve(args.query, top=args.top, weights=weights)
    if args.json:
        print(json.dumps([hit.to_json() for hit in hits], indent=2))
        return 0
    for rank, hit in enumerate(hits, 1):
        shares = "  ".join(f"{name} {100 * s['share']:3.0f}%" for name, s in hit.signals.items())
        print(f"{rank:3d}  {hit.score:.3f}  {hit.page}  ({hit.title})  {shares}")
    return 0
