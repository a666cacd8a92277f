"""The retrieval index of a folder of linked markdown pages (SPEC "cybergraph retrieval"): pages, their links,
embeddings, gravity and recency, and a query's ranked pages by SPEC's relevance formula.

Owns: reading the folder safely, frontmatter and link parsing, link resolution (paths, file names, titles,
aliases), the link graph, PageRank (gravity) and personalized PageRank (link proximity), recency, scoring,
incremental updates, and the index file. Knows an encoder only as an object with `embed(texts) -> [N, D]`;
nothing of models, engines, contexts or servers.

Pages: the `.md`/`.markdown` files under DIR, hidden files and folders (a name starting with ".") aside.
Frontmatter is a leading `---` block of `key: value`, `key: [a, b]` and `key:` followed by `- item` lines
(title, aliases, date, tags; the rest kept as given). Links: `[[target]]`, `[[target|shown]]`,
`[[target#heading]]` (and `![[...]]`) resolve by relative path, file name, title, then alias (case-folded);
markdown links `[text](path.md)` resolve relative to the page; links in fenced code, to URLs, to the page
itself, or to no page are not edges (the unresolved are counted).

Bad input: nothing outside DIR is read (symlinks are never followed: each is a skip, saying whether it points
out of DIR); a page that is binary (a NUL byte), not UTF-8, or over MAX_PAGE_BYTES is a skip with its reason;
a page's first MAX_LINKS distinct links are kept, the rest dropped and reported; link cycles are ordinary.

Signals, each min-max normalized to [0, 1] over a query's candidates (a signal equal on all of them is 0):
similarity (cosine of the query's and the page's embeddings), proximity (personalized PageRank from the
seeds, the SEEDS pages most similar to the query, weighted by exp(similarity / SEED_TEMPERATURE): the walk
starts mostly from the best match), gravity (PageRank over all
links), recency (2 ** -(age / half_life), age from the frontmatter date, else the file's mtime; default
half-life HALF_LIFE_DAYS). Candidates: the CANDIDATES pages most similar to the query and the pages within
HOPS outgoing links of a seed. score = α·similarity + β·proximity + γ·gravity + δ·recency (Weights; the
defaults 0.3, 0.5, 0.1, 0.1 favour the link walk: chosen on bench/retrieval.py's generated multi-hop set
and the tests' corpus, where similarity-led weights found few answers that only a link reaches).

The index file (DIR/.soma-index.npz, written whole or not at all): a numpy .npz of `vectors` (float32
[pages, D], L2-normalized, in the order of meta's pages) and `meta` (a 0-d string array holding JSON:
format FORMAT, model, dim, pages with path, title, aliases, tags, date, time, mtime_ns, size, sha256, links
as written ("w:" wiki target, "p:" path) and links dropped by the cap, and the last update's skips).
Edges and PageRank are derived on load. An update re-reads a page only where its mtime or size changed
and re-embeds it only where its sha256 changed.
"""
from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import posixpath
import re
import stat
import tempfile
import time
import urllib.parse
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone

import numpy as np

from soma_runtime.errors import RequestError

log = logging.getLogger("soma_runtime.context")

FORMAT = 1                          # the index file's version
INDEX_FILE = ".soma-index.npz"
PAGE_SUFFIXES = (".md", ".markdown")
MAX_PAGE_BYTES = 5 * 2**20          # a larger page is skipped
MAX_LINKS = 1000                    # distinct links kept per page
MAX_FRONTMATTER_LINES = 200
EMBED_CHARS = 1000                  # a page is embedded by its title, aliases and this much of its body (MiniLM reads 256 tokens)
EMBED_BATCH = 32
SEEDS = 3                           # the most similar pages the walk starts from
SEED_TEMPERATURE = 0.05             # seeds weigh exp(similarity / this)
HOPS = 2                            # how far from a seed a page is a candidate
CANDIDATES = 50                     # the most similar pages that are candidates whatever their links
HALF_LIFE_DAYS = 30.0
DAMPING = 0.85
DAY = 86400.0
SIGNALS = ("similarity", "proximity", "gravity", "recency")

WIKI_LINK = re.compile(r"\[\[([^\[\]\|#\n]*)(#[^\[\]\|\n]*)?(?:\|([^\[\]\n]*))?\]\]")
MD_LINK = re.compile(r"\[[^\[\]\n]*\]\(\s*<?([^()\s<>]+)>?(?:\s+\"[^\"\n]*\")?\s*\)")
FENCE = re.compile(r"^(```|~~~).*?^\1[^\n]*$", re.DOTALL | re.MULTILINE)
HEADING = re.compile(r"^#\s+(.+?)\s*#*\s*$", re.MULTILINE)
KEY_VALUE = re.compile(r"^([A-Za-z_][\w-]*)\s*:\s*(.*)$")
LIST_ITEM = re.compile(r"^\s*-\s+(.*)$")
SCHEME = re.compile(r"^[a-zA-Z][a-zA-Z0-9+.-]*:")


class RetrievalError(RequestError):
    """An index that cannot be read, built or queried, or a page that cannot be one: the message names the
    folder, file or page."""


@dataclass
class Weights:
    """SPEC's α, β, γ, δ (any values >= 0, not all 0; their scale does not change the ranking)."""
    similarity: float = 0.3
    proximity: float = 0.5
    gravity: float = 0.1
    recency: float = 0.1

    def __post_init__(self):
        values = [getattr(self, s) for s in SIGNALS]
        if not all(isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v >= 0 for v in values) \
                or sum(values) == 0:
            raise RetrievalError(f"weights must be finite numbers >= 0, not all 0, got {dict(zip(SIGNALS, values))}")

    def array(self) -> np.ndarray:
        return np.array([getattr(self, s) for s in SIGNALS], dtype=np.float64)


@dataclass
class Page:
    path: str                       # relative to DIR, with "/"
    title: str
    aliases: list[str]
    tags: list[str]
    date: str | None                # the frontmatter's, as written
    time: float                     # seconds since the epoch: the date's, else the mtime
    mtime_ns: int
    size: int
    sha256: str
    links: list[str]                # "w:<wiki target>" or "p:<path relative to DIR>", distinct, at most MAX_LINKS
    dropped_links: int = 0          # past the cap


@dataclass
class Skip:
    path: str
    reason: str


@dataclass
class Hit:
    page: str
    title: str
    score: float
    signals: dict                   # signal -> {"raw", "normalized", "share"} (share: its part of the score)

    def to_json(self) -> dict:
        return {"page": self.page, "score": self.score, "signals": self.signals}


@dataclass
class Report:
    """What an update did: pages now indexed, embedded in it, unchanged, removed; links; skips and caps."""
    pages: int
    embedded: int
    unchanged: int
    removed: int
    links: int
    unresolved: int
    ignored: int                    # files that are not pages (other suffixes; hidden ones are not counted)
    skips: list[Skip] = field(default_factory=list)
    capped: list[dict] = field(default_factory=list)
    seconds: float = 0.0

    def to_json(self) -> dict:
        return asdict(self)


def recorded_model(directory: str, path: str | None = None) -> str | None:
    """The encoder an index file was built with (None: no index file there yet)."""
    path = path or os.path.join(os.path.realpath(directory), INDEX_FILE)
    if not os.path.isfile(path):
        return None
    try:
        with np.load(path, allow_pickle=False) as archive:
            return json.loads(str(archive["meta"]))["model"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise RetrievalError(f"{path}: not a readable index ({type(e).__name__}: {e}); delete it to rebuild") from None


# --- parsing ----------------------------------------------------------------------------------------

def parse_frontmatter(text: str) -> tuple[dict, str]:
    """(the leading `---` block's keys, the body); text without a closed block is all body."""
    if not text.startswith("---"):
        return {}, text
    lines = text.split("\n")
    if lines[0].strip() != "---":
        return {}, text
    end = next((i for i in range(1, min(len(lines), MAX_FRONTMATTER_LINES)) if lines[i].strip() in ("---", "...")), None)
    if end is None:
        return {}, text
    meta, key = {}, None
    for line in lines[1:end]:
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        item = LIST_ITEM.match(line)
        if item and key is not None:
            if not isinstance(meta[key], list):
                meta[key] = [meta[key]] if meta[key] else []
            meta[key].append(unquote(item[1]))
            continue
        pair = KEY_VALUE.match(line)
        if pair:
            key, value = pair[1].lower(), pair[2].strip()
            meta[key] = [unquote(v) for v in value[1:-1].split(",") if v.strip()] \
                if value.startswith("[") and value.endswith("]") else unquote(value)
    return meta, "\n".join(lines[end + 1:])


def without_suffix(path: str) -> str:
    """A page's path or name less its .md/.markdown suffix (any other is part of the name)."""
    lower = path.lower()
    return next((path[: -len(suffix)] for suffix in PAGE_SUFFIXES if lower.endswith(suffix)), path)


def unquote(value: str) -> str:
    value = value.strip()
    return value[1:-1] if len(value) >= 2 and value[0] == value[-1] and value[0] in "'\"" else value


def as_list(value) -> list[str]:
    if isinstance(value, list):
        return [v for v in value if v]
    return [v.strip() for v in value.split(",") if v.strip()] if isinstance(value, str) and value else []


def parse_date(value) -> float | None:
    """A frontmatter date (ISO 8601: a day, or a day and time; UTC where no zone is given) in epoch seconds."""
    if not isinstance(value, str) or not value:
        return None
    try:
        moment = datetime.fromisoformat(value.strip())
    except ValueError:
        return None
    if moment.tzinfo is None:
        moment = moment.replace(tzinfo=timezone.utc)
    return moment.timestamp()


def parse_links(body: str, path: str) -> list[str]:
    """The page's distinct link keys in order of appearance (fenced code aside), uncapped."""
    body = FENCE.sub("", body)
    found = [(m.start(), "w:" + m[1].strip()) for m in WIKI_LINK.finditer(body) if m[1].strip()]
    here = posixpath.dirname(path)
    for m in MD_LINK.finditer(body):
        target = m[1]
        if SCHEME.match(target) or target.startswith("#"):
            continue
        target = urllib.parse.unquote(target.split("#", 1)[0])
        joined = posixpath.normpath(posixpath.join(here, target.lstrip("/")) if not target.startswith("/") else target[1:])
        if joined.startswith("../") or joined == "..":
            continue
        found.append((m.start(), "p:" + joined))
    return list(dict.fromkeys(key for _, key in sorted(found)))


def link_text(body: str) -> str:
    """The body as read: `[[target|shown]]` as its shown text, `[[target]]` as the target."""
    return WIKI_LINK.sub(lambda m: (m[3] or m[1]).strip(), body)


# --- reading the folder -----------------------------------------------------------------------------

class Folder:
    """DIR's files, read without following a symlink or leaving DIR."""

    def __init__(self, directory: str):
        if not os.path.isdir(directory):
            raise RetrievalError(f"{directory}: not a directory")
        self.root = os.path.realpath(directory)

    def scan(self) -> tuple[dict[str, os.stat_result], list[Skip], int]:
        """({relative path: lstat} of candidate pages, skips, files ignored)."""
        pages, skips, ignored = {}, [], 0
        folders = [("", self.root)]
        while folders:
            prefix, folder = folders.pop()
            with os.scandir(folder) as entries:
                listed = sorted(entries, key=lambda e: e.name)
            for entry in listed:
                name, rel = entry.name, prefix + entry.name
                if name.startswith("."):
                    continue
                if entry.is_symlink():
                    if entry.is_dir() or name.lower().endswith(PAGE_SUFFIXES):
                        skips.append(Skip(rel, self.symlink_reason(entry.path)))
                    else:
                        ignored += 1
                elif entry.is_dir(follow_symlinks=False):
                    folders.append((rel + "/", entry.path))
                elif not name.lower().endswith(PAGE_SUFFIXES):
                    ignored += 1
                else:
                    info = entry.stat(follow_symlinks=False)
                    if not stat.S_ISREG(info.st_mode):
                        skips.append(Skip(rel, "not a regular file"))
                    elif info.st_size > MAX_PAGE_BYTES:
                        skips.append(Skip(rel, f"{info.st_size} bytes, over the {MAX_PAGE_BYTES}-byte page limit"))
                    else:
                        pages[rel] = info
        return pages, skips, ignored

    def symlink_reason(self, full: str) -> str:
        target = os.path.realpath(full)
        inside = target == self.root or target.startswith(self.root + os.sep)
        return "a symlink, not followed" + ("" if inside else " (it points outside the folder)")

    def read(self, rel: str) -> str:
        """A page's text (RetrievalError saying why it cannot be a page); never through a symlink or out of DIR."""
        if rel.startswith("/") or ".." in rel.split("/"):
            raise RetrievalError(f"{rel}: not a path inside the folder")
        full = os.path.join(self.root, *rel.split("/"))
        if os.path.realpath(full) != full:
            raise RetrievalError(f"{rel}: a symlink (or under one), not followed")
        try:
            fd = os.open(full, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
        except OSError as e:
            raise RetrievalError(f"{rel}: cannot be read ({e.strerror})") from None
        with os.fdopen(fd, "rb") as f:
            if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):
                raise RetrievalError(f"{rel}: not a regular file")
            data = f.read(MAX_PAGE_BYTES + 1)
        if len(data) > MAX_PAGE_BYTES:
            raise RetrievalError(f"{rel}: over the {MAX_PAGE_BYTES}-byte page limit")
        return decode(data, rel)


def decode(data: bytes, rel: str) -> str:
    nul = data.find(b"\0")
    if nul >= 0:
        raise RetrievalError(f"{rel}: binary (a NUL byte at offset {nul})")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise RetrievalError(f"{rel}: not UTF-8 (byte {e.start})") from None


# --- PageRank ---------------------------------------------------------------------------------------

def pagerank(n: int, src: np.ndarray, dst: np.ndarray, personalization: np.ndarray | None = None,
             alpha: float = DAMPING, max_iter: int = 100, tol: float = 1e-6) -> np.ndarray:
    """networkx.pagerank's power iteration over the unweighted edges src -> dst: start uniform, a dangling
    page's rank goes out as the personalization does, stop once the L1 change is under n * tol (networkx
    raises past max_iter; this returns the last iterate). `personalization`: one weight per page (None:
    uniform; all 0: uniform)."""
    if n == 0:
        return np.zeros(0)
    out_degree = np.bincount(src, minlength=n).astype(np.float64)
    dangling = out_degree == 0
    share = np.divide(1.0, out_degree, out=np.zeros(n), where=~dangling)[src]
    p = np.full(n, 1.0 / n) if personalization is None or personalization.sum() <= 0 else \
        np.asarray(personalization, np.float64) / personalization.sum()
    x = np.full(n, 1.0 / n)
    for _ in range(max_iter):
        last = x
        x = alpha * (np.bincount(dst, weights=last[src] * share, minlength=n) + last[dangling].sum() * p) + (1 - alpha) * p
        if np.abs(x - last).sum() < n * tol:
            break
    return x


def within_hops(indptr: np.ndarray, indices: np.ndarray, seeds: np.ndarray, hops: int) -> np.ndarray:
    """The pages reachable from `seeds` by at most `hops` outgoing links (seeds included)."""
    reached = np.zeros(len(indptr) - 1, dtype=bool)
    reached[seeds] = True
    frontier = np.asarray(seeds)
    for _ in range(hops):
        if frontier.size == 0:
            break
        nxt = np.concatenate([indices[indptr[i]:indptr[i + 1]] for i in frontier])
        nxt = np.unique(nxt[~reached[nxt]])
        reached[nxt] = True
        frontier = nxt
    return np.flatnonzero(reached)


def normalized(values: np.ndarray) -> np.ndarray:
    low, high = values.min(), values.max()
    return (values - low) / (high - low) if high > low else np.zeros_like(values)


# --- the index --------------------------------------------------------------------------------------

class PageIndex:
    """The index of one folder (the module's docstring says what it holds and how it ranks)."""

    def __init__(self, directory: str, encoder, model: str = "minilm", path: str | None = None,
                 half_life_days: float = HALF_LIFE_DAYS):
        """`encoder`: anything with `embed(list of texts) -> [N, D]` (None: the index can be read and shown but
        not updated or queried); `model`: its name, recorded in the file (an index of another model's vectors
        is re-embedded whole); `path`: the index file (default DIR/.soma-index.npz)."""
        self.folder = Folder(directory)
        self.directory, self.encoder, self.model = directory, encoder, model
        self.path = path or os.path.join(self.folder.root, INDEX_FILE)
        if not (isinstance(half_life_days, (int, float)) and half_life_days > 0):
            raise RetrievalError(f"half_life_days must be a number above 0, got {half_life_days!r}")
        self.half_life_days = float(half_life_days)
        self.pages: list[Page] = []
        self.vectors = np.zeros((0, 0), np.float32)
        self.skips: list[Skip] = []
        self.loaded_mtime_ns = None
        if os.path.exists(self.path):
            self.load()
        self.derive()

    # --- persist ---

    def load(self) -> None:
        try:
            with np.load(self.path, allow_pickle=False) as archive:
                meta, vectors = json.loads(str(archive["meta"])), archive["vectors"]
            if meta.get("format") != FORMAT:
                raise ValueError(f"format {meta.get('format')!r}, this runtime reads {FORMAT}")
            pages = [Page(**p) for p in meta["pages"]]
            if vectors.shape[0] != len(pages):
                raise ValueError(f"{vectors.shape[0]} vectors for {len(pages)} pages")
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise RetrievalError(f"{self.path}: not a readable index ({type(e).__name__}: {e}); delete it to rebuild") from None
        self.loaded_mtime_ns = os.stat(self.path).st_mtime_ns
        if meta["model"] != self.model and self.encoder is not None:
            log.info("%s: embedded by %s, not %s: every page is embedded again", self.path, meta["model"], self.model)
            return
        self.model = meta["model"]
        self.pages, self.vectors, self.skips = pages, vectors.astype(np.float32), [Skip(**s) for s in meta["skips"]]

    def save(self) -> None:
        meta = {"format": FORMAT, "model": self.model, "dim": int(self.vectors.shape[1]) if self.pages else 0,
                "pages": [vars(p) for p in self.pages], "skips": [asdict(s) for s in self.skips]}     # vars: asdict copies
        directory = os.path.dirname(self.path)
        with tempfile.NamedTemporaryFile(dir=directory, prefix=".soma-index-", suffix=".tmp.npz", delete=False) as f:
            np.savez(f, vectors=self.vectors, meta=np.array(json.dumps(meta, ensure_ascii=False)))
        os.replace(f.name, self.path)
        self.loaded_mtime_ns = os.stat(self.path).st_mtime_ns

    def refresh(self) -> bool:
        """Reload the file if another process rewrote it since (the server's copy follows `soma-runtime index`)."""
        try:
            mtime = os.stat(self.path).st_mtime_ns
        except OSError:
            return False
        if mtime == self.loaded_mtime_ns:
            return False
        self.load()
        self.derive()
        return True

    # --- build and update ---

    def update(self) -> Report:
        """Bring the index up to date with the folder (a new index: every page) and write the file if anything
        changed: a page whose mtime or size changed is read again, and embedded again if its content did."""
        if self.encoder is None:
            raise RetrievalError(f"{self.directory}: an index opened without an encoder cannot be updated")
        began = time.perf_counter()
        found, skips, ignored = self.folder.scan()
        old = {p.path: (p, self.vectors[i]) for i, p in enumerate(self.pages)}
        kept, fresh, unchanged = [], [], 0
        for rel, info in sorted(found.items()):
            before = old.get(rel)
            if before and before[0].mtime_ns == info.st_mtime_ns and before[0].size == info.st_size:
                kept.append(before)
                unchanged += 1
                continue
            try:
                text = self.folder.read(rel)
            except RetrievalError as e:
                skips.append(Skip(rel, str(e).split(": ", 1)[1]))
                continue
            page, embed_text = self.parse(rel, text, info)
            if before and before[0].sha256 == page.sha256:
                kept.append((page, before[1]))
                unchanged += 1
            else:
                kept.append((page, None))
                fresh.append((len(kept) - 1, embed_text))
        if fresh:
            vectors = self.embed([t for _, t in fresh])
            for (i, _), v in zip(fresh, vectors):
                kept[i] = (kept[i][0], v)
        removed = len(set(old) - {p.path for p, _ in kept})
        changed = bool(fresh) or removed or len(kept) != len(self.pages) or \
            any(a != b for a, b in zip((p for p, _ in kept), self.pages)) or skips != self.skips
        self.pages = [p for p, _ in kept]
        dim = kept[0][1].shape[0] if kept else 0
        self.vectors = np.stack([v for _, v in kept]).astype(np.float32) if kept else np.zeros((0, dim), np.float32)
        self.skips = sorted(skips, key=lambda s: s.path)
        self.derive()
        if changed or not os.path.exists(self.path):
            self.save()
        return Report(len(self.pages), len(fresh), unchanged, removed, len(self.src), self.unresolved, ignored, self.skips,
                      [{"path": p.path, "links": len(p.links) + p.dropped_links, "kept": len(p.links)}
                       for p in self.pages if p.dropped_links], time.perf_counter() - began)

    def parse(self, rel: str, text: str, info: os.stat_result) -> tuple[Page, str]:
        """A page's record and the text its embedding is of."""
        digest = hashlib.sha256(text.encode("utf-8")).hexdigest()
        text = text.replace("\r\n", "\n")
        meta, body = parse_frontmatter(text)
        heading = HEADING.search(body)
        stem = posixpath.splitext(posixpath.basename(rel))[0]
        title = meta.get("title") if isinstance(meta.get("title"), str) and meta.get("title") else \
            heading[1] if heading else stem
        aliases = as_list(meta.get("aliases", meta.get("alias")))
        date = meta.get("date") if isinstance(meta.get("date"), str) and meta.get("date") else None
        moment = parse_date(date)
        links = parse_links(body, rel)
        page = Page(rel, title, aliases, as_list(meta.get("tags")), date, info.st_mtime_ns / 1e9 if moment is None else moment,
                    info.st_mtime_ns, info.st_size, digest, links[:MAX_LINKS], max(0, len(links) - MAX_LINKS))
        return page, "\n".join([title, ", ".join(aliases), link_text(body).strip()])[:EMBED_CHARS]

    def embed(self, texts: list[str]) -> np.ndarray:
        parts = [np.asarray(self.encoder.embed(texts[i:i + EMBED_BATCH]), np.float32) for i in range(0, len(texts), EMBED_BATCH)]
        vectors = np.concatenate(parts)
        if vectors.ndim != 2 or vectors.shape[0] != len(texts):
            raise RetrievalError(f"the encoder gave vectors of shape {vectors.shape} for {len(texts)} texts")
        return vectors / np.maximum(np.linalg.norm(vectors, axis=1, keepdims=True), 1e-12)

    def derive(self) -> None:
        """Edges (links resolved against the pages now indexed), their CSR form, and gravity."""
        by_path = {p.path: i for i, p in enumerate(self.pages)}
        bare = [without_suffix(p.path) for p in self.pages]
        by_name: dict[str, int] = {}
        for names in (bare, [b.rsplit("/", 1)[-1] for b in bare], [p.title for p in self.pages]):   # earlier kinds win
            for i, name in enumerate(names):
                by_name.setdefault(name.strip().casefold(), i)
        for i, p in enumerate(self.pages):
            for alias in p.aliases:
                by_name.setdefault(alias.strip().casefold(), i)
        src, dst, unresolved = [], [], 0
        for i, p in enumerate(self.pages):
            targets = set()
            for key in p.links:
                target = key[2:]
                if key.startswith("p:"):
                    j = by_path.get(target, by_path.get(target + ".md"))
                else:
                    name = target.casefold()
                    j = by_name.get(name, by_name.get(without_suffix(name)))
                if j is None:
                    unresolved += 1
                elif j != i:
                    targets.add(j)
            src += [i] * len(targets)
            dst += sorted(targets)
        n = len(self.pages)
        self.src, self.dst = np.array(src, dtype=np.int64), np.array(dst, dtype=np.int64)
        self.indptr = np.concatenate([[0], np.cumsum(np.bincount(self.src, minlength=n))]).astype(np.int64)
        self.indices = self.dst                                  # src is sorted: dst is the CSR column list
        self.unresolved = unresolved
        self.gravity = pagerank(n, self.src, self.dst)
        self.times = np.array([p.time for p in self.pages], dtype=np.float64)
        self.by_path = by_path

    # --- query ---

    def retrieve(self, query: str, top: int = 5, weights: Weights | None = None, seeds: int = SEEDS,
                 now: float | None = None) -> list[Hit]:
        """The `top` pages for `query`, best first, each with its signals (the module's docstring says how)."""
        if not isinstance(query, str) or not query.strip():
            raise RetrievalError("the query must be non-empty text")
        if isinstance(top, bool) or not isinstance(top, int) or top < 1:
            raise RetrievalError(f"top must be an integer >= 1, got {top!r}")
        if self.encoder is None:
            raise RetrievalError(f"{self.directory}: an index opened without an encoder cannot be queried")
        weights = weights or Weights()
        n = len(self.pages)
        if n == 0:
            return []
        q = np.asarray(self.encoder.embed([query]), np.float32).reshape(-1)
        if q.shape[0] != self.vectors.shape[1]:
            raise RetrievalError(f"the encoder gives {q.shape[0]} dimensions; the index holds {self.vectors.shape[1]}")
        similarity = self.vectors @ (q / max(float(np.linalg.norm(q)), 1e-12))
        order = np.argsort(-similarity, kind="stable")
        starts = order[:seeds]
        personalization = np.zeros(n)
        personalization[starts] = np.exp((similarity[starts] - similarity[starts[0]]) / SEED_TEMPERATURE)
        proximity = pagerank(n, self.src, self.dst, personalization)
        candidates = np.union1d(order[:CANDIDATES], within_hops(self.indptr, self.indices, starts, HOPS))
        age_days = np.maximum(0.0, ((time.time() if now is None else now) - self.times[candidates]) / DAY)
        raw = np.stack([similarity[candidates], proximity[candidates], self.gravity[candidates],
                        np.exp2(-age_days / self.half_life_days)], axis=1)
        norm = np.stack([normalized(raw[:, k]) for k in range(len(SIGNALS))], axis=1)
        parts = norm * weights.array()
        scores = parts.sum(axis=1)
        best = np.lexsort((-raw[:, 0], -scores))[:top]          # ties: the more similar first
        hits = []
        for k in best:
            page = self.pages[candidates[k]]
            total = scores[k]
            hits.append(Hit(page.path, page.title, float(total), {
                s: {"raw": float(raw[k, j]), "normalized": float(norm[k, j]),
                    "share": float(parts[k, j] / total) if total > 0 else 0.0} for j, s in enumerate(SIGNALS)}))
        return hits

    # --- show ---

    def render(self, hit: Hit) -> str:
        """A retrieved page as the graph block holds it: a header with its path and score, its frontmatter,
        its body, and its links resolved to pages (read from the folder now)."""
        i = self.by_path[hit.page]
        page = self.pages[i]
        _, body = parse_frontmatter(self.folder.read(page.path).replace("\r\n", "\n"))
        front = {"title": page.title, **({"aliases": page.aliases} if page.aliases else {}),
                 **({"date": page.date} if page.date else {}), **({"tags": page.tags} if page.tags else {})}
        lines = [f"## page: {page.path} (relevance {hit.score:.3f})", "---"]
        lines += [f"{k}: [{', '.join(v)}]" if isinstance(v, list) else f"{k}: {v}" for k, v in front.items()]
        lines.append("---")
        lines.append(body.strip())
        linked = [self.pages[j].path for j in self.indices[self.indptr[i]:self.indptr[i + 1]]]
        if linked:
            lines.append("links: " + ", ".join(linked))
        return "\n".join(lines)

    def report(self) -> dict:
        return {"directory": self.directory, "file": self.path, "model": self.model, "pages": len(self.pages),
                "links": len(self.src), "unresolved": self.unresolved, "skips": [asdict(s) for s in self.skips]}
