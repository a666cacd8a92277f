"""The paged KV cache: every layer's K and V live in fixed-size pages drawn from one pool, shaped by
the model's cache spec (architectures/contract.py), and each step's attention inputs built from it.

A sequence owns a block table (its pages, in order); token position p lives in slot
`table[p // block] * block + p % block`. Page 0 is never handed out: padded context slots point
there, and attention masks them out. Where every layer attends within a sliding window, a sequence
lets go of the pages behind its window as it runs on, so it holds a window's worth however long it grows.

Prefix caching: a full page is published under the hash of every token up to its end, so a later
sequence whose prompt starts with the same tokens attaches those pages instead of computing them
(a shared system prompt is prefilled once). Pages are reference-counted; a published page nobody
holds stays cached until the pool needs it back, least recently used first.

Float copies: a compressed cache with sinks or a window (quant/kv.py) keeps f16 copies of a sequence's
first page (its sinks; published with it) and of its pages near its end (every row's window), in copy
pages of their own, taken as a sequence's rows are appended and let go once every later row's window
has passed them. Prefixes are shared where only sinks are kept (their copies published with the first
page), not under a window (a row after the prefix would read codes where its own run reads copies).
Where copy pages run out, rows are read from their codes.
"""
from __future__ import annotations

import weakref
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from soma_runtime.architectures.contract import Attention, PagedKV, kv_flat, kv_pages
from soma_runtime.errors import RequestError
from soma_runtime.quant import kv

BUCKET = 128        # a sequence's segment of a step's context is a multiple of this many slots
ROLLBACK = 16       # tokens a sequence may be rolled back (rejected drafts); pages behind its window stay this long
BLOCK = 16          # tokens a page


@dataclass(frozen=True)
class Variant:
    """What a sequence's K/V are computed under besides its tokens: an adapter's slot in the step's LoRA
    stacks (-1: none) and its scale. `key` stands for it in the prefix cache (0: the base model alone;
    never the same for two adapters or two loads of one), so a prefix is reused only under what made it."""
    slot: int = -1
    scale: float = 0.0
    key: int = 0


BASE = Variant()


@dataclass(eq=False)
class Sequence:
    pages: list[int] = field(default_factory=list)      # its block table from page `dropped` on
    length: int = 0                   # tokens whose K/V are in the cache
    published: int = 0                # leading pages already in the prefix cache
    dropped: int = 0                  # leading pages let go: behind every layer's window
    copies: dict[int, int] = field(default_factory=dict)   # page index -> its float copies' page (a compressed cache's)
    variant: Variant = BASE           # the adapter its rows run under


def prefix_hashes(tokens: list[int], block: int, key: int = 0) -> list[int]:
    """One hash per full block: of the block's tokens chained to the hash of everything before it, from
    `key` (a Variant's: what the K/V were computed under)."""
    hashes, h = [], key
    for start in range(0, len(tokens) - block + 1, block):
        h = hash((h, tuple(tokens[start:start + block])))
        hashes.append(h)
    return hashes


def pool_slots(tokens: int, block: int = BLOCK) -> int:
    """The token slots a pool for `tokens` tokens allocates: whole pages, and page 0, which stays empty."""
    return (-(-tokens // block) + 1) * block


class KVPool:
    def __init__(self, cache: PagedKV, max_tokens: int, backend_of: Callable, block: int = BLOCK):
        """The pages of a model's `cache` for `max_tokens` tokens, each layer's where `backend_of(layer)`
        computes it (on the host: memory mapped lazily, so they grow with the tokens actually cached).
        A compressed layer's pages hold bytes (PagedKV.page_shape)."""
        self.block, self.horizon, self.backend_of = block, cache.horizon, backend_of
        self.num_pages = pool_slots(max_tokens, block) // block
        self.k, self.v = ([backend_of(i).zeros(*cache.page_shape(i, which, self.num_pages, block)) for i in range(cache.layers)]
                          for which in (0, 1))
        self.free = list(range(self.num_pages - 1, 0, -1))
        self.refs = np.zeros(self.num_pages, np.int32)
        self.by_hash: dict[int, int] = {}          # prefix hash -> page
        self.hash_of: dict[int, int] = {}          # page -> prefix hash
        self.idle: OrderedDict[int, None] = OrderedDict()   # published pages nobody holds, LRU first
        self.live: weakref.WeakSet[Sequence] = weakref.WeakSet()   # sequences holding pages (recompression)
        self.sinks = self.window = 0
        self.kc, self.vc = [None] * cache.layers, [None] * cache.layers
        self.copy_free: list[int] = []
        self.copy_refs = np.zeros(self.num_pages, np.int32)
        self.sink_copy: dict[int, int] = {}        # a published first page -> its copies' page
        self.copied = False                        # whether some layer keeps float copies
        self.keep_copies(cache)

    def keep_copies(self, cache: PagedKV) -> None:
        """Copy pages for the layers of `cache` that keep float copies (none: all let go). Page 0 of the
        copies is scratch: rows that get no copy are written there, and nothing reads it."""
        layout = cache.layout
        self.sinks, self.window = layout.sinks, layout.window
        for layer in range(cache.layers):
            kept = layout.float_copies(layer)
            if kept and self.kc[layer] is None:
                shape = cache.copy_page_shape(self.num_pages, self.block)
                self.kc[layer], self.vc[layer] = (self.backend_of(layer).zeros(*shape) for _ in range(2))
            elif not kept:
                self.kc[layer] = self.vc[layer] = None
        was, self.copied = self.copied, any(c is not None for c in self.kc)
        if not self.copied:
            self.copy_free, self.sink_copy = [], {}
            self.copy_refs[:] = 0
            for seq in self.live:
                seq.copies = {}
        elif not was:
            self.copy_free = list(range(self.num_pages - 1, 0, -1))

    @property
    def available(self) -> int:
        """Pages a sequence can still get: free ones plus cached ones nobody holds."""
        return len(self.free) + len(self.idle)

    @property
    def in_use(self) -> int:
        return self.num_pages - 1 - self.available

    def pages_for(self, tokens: int) -> int:
        return -(-tokens // self.block)

    def _take(self) -> int:
        if self.free:
            page = self.free.pop()
        else:                                      # reclaim the least recently used cached page
            page, _ = self.idle.popitem(last=False)
            del self.by_hash[self.hash_of.pop(page)]
            if page in self.sink_copy:
                self._drop_copy(self.sink_copy.pop(page))
        self.refs[page] = 1
        return page

    def reserve(self, seq: Sequence, total_tokens: int) -> None:
        """Pages for `seq` to run on to `total_tokens`, those behind its window let go first."""
        if self.horizon:
            behind = max(0, seq.length - self.horizon + 1 - ROLLBACK) // self.block - seq.dropped
            self._let_go(seq.pages[:behind])
            seq.pages, seq.dropped = seq.pages[behind:], seq.dropped + behind
        need = self.pages_for(total_tokens) - seq.dropped - len(seq.pages)
        if need > self.available:
            raise RequestError(f"KV cache full: {total_tokens} tokens need {need} more pages, {self.available} free")
        seq.pages.extend(self._take() for _ in range(max(0, need)))
        self.live.add(seq)
        if self.copied:
            self._reserve_copies(seq, total_tokens)

    def _copies_wanted(self, index: int, length: int) -> bool:
        """Whether page `index` of a sequence `length` tokens long keeps float copies: its first (sinks), or
        one a later row's window (or a rollback's) may still reach."""
        return (index == 0 and self.sinks > 0) or (self.window > 0 and (index + 1) * self.block > length - self.window - ROLLBACK)

    def _reserve_copies(self, seq: Sequence, total_tokens: int) -> None:
        """Let go of `seq`'s copies no row will read again; take copy pages for its rows up to `total_tokens`."""
        for index in [i for i in seq.copies if not self._copies_wanted(i, seq.length) or i < seq.dropped]:
            self._drop_copy(seq.copies.pop(index))
        for index in range(seq.length // self.block, self.pages_for(total_tokens)):   # the step's rows read them all
            if index not in seq.copies and self._copies_wanted(index, seq.length) and self.copy_free:
                seq.copies[index] = self.copy_free.pop()
                self.copy_refs[seq.copies[index]] = 1

    def _drop_copy(self, page: int) -> None:
        self.copy_refs[page] -= 1
        if self.copy_refs[page] == 0:
            self.copy_free.append(page)

    @property
    def pages(self) -> list:
        """Every layer's key and value pages, in the graph's order (k, v per layer)."""
        return kv_flat(self.k, self.v)

    @property
    def copies(self) -> list:
        """Every layer's key and value copy pages (k, v per layer; None for a layer that keeps none)."""
        return kv_flat(self.kc, self.vc)

    def transcode(self, source: PagedKV, target: PagedKV) -> None:
        """Every layer's pages re-encoded from `source`'s kinds into `target`'s (quant/kv.py), the pages that
        hold something (a sequence's, the prefix cache's) converted, the rest left unwritten: sequences
        and published prefixes go on in the new cache where they were. Where the target keeps float
        copies the source did not, running sequences get theirs from the source's values."""
        held = np.flatnonzero(self.refs > 0).tolist() + list(self.idle)
        had_copies = [c is not None for c in self.kc]
        old_pages = (list(self.k), list(self.v))
        for which, pages in enumerate((self.k, self.v)):
            for layer, old in enumerate(pages):
                backend = self.backend_of(layer)
                new = backend.zeros(*target.page_shape(layer, which, self.num_pages, self.block))
                if held:
                    kinds = source.layout.kinds[layer][which], target.layout.kinds[layer][which]
                    centers = (None, None) if which else (source.key_center(layer), target.key_center(layer))
                    values = kv.transcode(np.asarray(backend.fetch(old[held])), *kinds, target.head_dim, centers)
                    new[held] = backend.place(values)
                pages[layer] = new
        self.keep_copies(target)
        fresh = [layer for layer in range(target.layers) if self.kc[layer] is not None and not had_copies[layer]]
        if not fresh:
            return
        for seq in list(self.live):
            for index in range(seq.dropped, self.pages_for(seq.length)):
                if self._copies_wanted(index, seq.length) and index not in seq.copies and self.copy_free:
                    seq.copies[index] = self.copy_free.pop()
                    self.copy_refs[seq.copies[index]] = 1
            for index, copy in seq.copies.items():
                for which, copies in enumerate((self.kc, self.vc)):
                    for layer in fresh:
                        backend, kind = self.backend_of(layer), source.layout.kinds[layer][which]
                        centers = (None, None) if which else (source.key_center(layer), target.key_center(layer))
                        page = np.asarray(backend.fetch(old_pages[which][layer][seq.pages[index - seq.dropped]]))
                        values = kv.transcode(page, kind, "f32", target.head_dim, (centers[0], None))
                        values = kv.to_basis(values, target.layout.kinds[layer][which], target.head_dim, centers[1])
                        copies[layer][copy] = backend.place(values.astype(np.float16))

    def keep(self, pages: list, layers: range | None = None, copies: list = ()) -> None:
        """The pages (and copy pages, of the layers that keep them) a step returns for `layers` (default:
        all; a backend that updates out of place gives new ones)."""
        layers = range(len(self.k)) if layers is None else layers
        for i, layer in enumerate(layers):
            self.k[layer], self.v[layer] = kv_pages(pages, i)
        kept = iter(copies)
        for layer in layers:
            if copies and self.kc[layer] is not None:
                self.kc[layer], self.vc[layer] = next(kept), next(kept)

    def attention(self, batch: list[tuple[Sequence, int]], windows: list[int], context_for) -> Attention:
        """The attention inputs of a step running `n` new tokens of each sequence (their pages reserved).
        Each sequence's context sits in a segment of its own, BUCKET-aligned, its padding pointing at
        scratch page 0, and each row reads the span of it that it sees (causal, the last w under a
        window w), never another row's: a sequence gets the same numbers alone or batched.
        `context_for(slots)` gives the context length a step of that many slots runs with. Where the
        cache keeps float copies: each new row's copy slot, and the copy of each context position a row
        may read (its sinks, and the window of the step's rows)."""
        rows = sum(n for _, n in batch)
        firsts = [max(0, seq.length - self.horizon + 1) // self.block * self.block if self.horizon else 0 for seq, _ in batch]
        buckets = [-(-(seq.length + n - first) // BUCKET) * BUCKET for (seq, n), first in zip(batch, firsts)]
        ctx = np.zeros(context_for(sum(buckets)), np.int64)
        spans = {w: np.zeros((rows, 2), np.int64) for w in windows}
        copied = self.copied
        copy_ctx = np.full(len(ctx), -1, np.int64) if copied else None
        positions, written, copy_written, row, offset = [], [], [], 0, 0
        for (seq, n), bucket, first in zip(batch, buckets, firsts):
            start, stop = seq.length, seq.length + n
            slots = self.slots(seq, first, stop)              # the context read, ending in the slots written
            ctx[offset: offset + stop - first] = slots
            written.append(slots[start - first:])
            query = np.arange(start, stop)
            for w, span in spans.items():
                span[row: row + n, 0] = offset + (np.maximum(query - w + 1, 0) if w else 0) - first
                span[row: row + n, 1] = offset + query + 1 - first
            if copied:
                copy_written.append(self.copy_slots(seq, start, stop, 0))
                read = np.arange(first, stop)
                wanted = (read < self.sinks) | (read > start - self.window)
                copy_ctx[offset: offset + stop - first] = np.where(wanted, self.copy_slots(seq, first, stop, -1), -1)
            positions.append(query)
            row, offset = row + n, offset + bucket
        return Attention(np.concatenate(positions).astype(np.int64), np.concatenate(written), ctx, spans,
                         copy_ctx, np.concatenate(copy_written) if copied else None)

    def copy_slots(self, seq: Sequence, start: int, stop: int, missing: int) -> np.ndarray:
        """The copy slots of positions [start, stop) of `seq`, `missing` where their page keeps no copies."""
        at = np.arange(start, stop)
        pages = np.array([seq.copies.get(i, -1) for i in range(start // self.block, -(-stop // self.block))], np.int64)
        page = pages[at // self.block - start // self.block]
        return np.where(page >= 0, page * self.block + at % self.block, missing)

    def slots(self, seq: Sequence, start: int, stop: int) -> np.ndarray:
        assert start // self.block >= seq.dropped, "a sequence's pages behind its window were let go"
        pages = np.asarray(seq.pages[start // self.block - seq.dropped: -(-stop // self.block) - seq.dropped], np.int64)
        first = start // self.block * self.block
        return (pages[:, None] * self.block + np.arange(self.block)).reshape(-1)[start - first: stop - first]

    def attach_prefix(self, seq: Sequence, tokens: list[int]) -> int:
        """Give an empty sequence the cached pages of the longest published prefix of `tokens`, leaving
        at least the last token to compute (its logits are needed). Returns the tokens attached. None
        where the cache keeps a window of float copies: the rows after a prefix would read the codes of
        its last positions where a sequence that computed them reads their copies."""
        assert not seq.pages
        if self.window:
            return 0
        for h in prefix_hashes(tokens[:-1], self.block, seq.variant.key):
            page = self.by_hash.get(h)
            if page is None:
                break
            self.idle.pop(page, None)
            self.refs[page] += 1
            seq.pages.append(page)
        if seq.pages and seq.pages[0] in self.sink_copy:          # its sinks' copies come with its first page
            seq.copies[0] = self.sink_copy[seq.pages[0]]
            self.copy_refs[seq.copies[0]] += 1
        seq.length = seq.published = len(seq.pages)
        seq.length *= self.block
        return seq.length

    def publish(self, seq: Sequence, tokens: list[int]) -> None:
        """Publish the sequence's full pages, whose K/V are the cache of `tokens`' prefix."""
        full = min(seq.length, len(tokens)) // self.block
        first = max(seq.published, seq.dropped)
        for i, h in enumerate(prefix_hashes(tokens[: full * self.block], self.block, seq.variant.key)[first:], first):
            page = seq.pages[i - seq.dropped]
            if h not in self.by_hash and page not in self.hash_of:
                self.by_hash[h], self.hash_of[page] = page, h
                if i == 0 and self.sinks and 0 in seq.copies:     # a later sequence's sinks
                    self.sink_copy[page] = seq.copies[0]
                    self.copy_refs[seq.copies[0]] += 1
        seq.published = max(seq.published, full)

    def fork(self, seq: Sequence) -> Sequence:
        """A copy of `seq` to continue apart (a beam): its full pages shared (only ever read again), its
        partial last page copied."""
        full = seq.length // self.block - seq.dropped
        for page in seq.pages[:full]:
            self.refs[page] += 1
        copy = Sequence(seq.pages[:full], seq.length, dropped=seq.dropped, variant=seq.variant)
        if seq.length % self.block:
            page, source = self._take(), seq.pages[full]
            for pages in (*self.k, *self.v):
                pages[page] = pages[source]
            copy.pages.append(page)
        for index, page in seq.copies.items():          # full pages' copies shared, the last one's copied
            if index < full + seq.dropped or not self.copy_free:
                self.copy_refs[page] += 1
                copy.copies[index] = page
                continue
            copy.copies[index] = self.copy_free.pop()
            self.copy_refs[copy.copies[index]] = 1
            for pages in (*self.kc, *self.vc):
                if pages is not None:
                    pages[copy.copies[index]] = pages[page]
        self.live.add(copy)
        return copy

    def release(self, seq: Sequence) -> None:
        self._let_go(seq.pages)
        for page in seq.copies.values():
            self._drop_copy(page)
        seq.pages, seq.length, seq.published, seq.dropped, seq.copies = [], 0, 0, 0, {}
        self.live.discard(seq)

    def _let_go(self, pages: list[int]) -> None:
        """A sequence's hold on `pages` ends: each nobody else holds is free again, or cached if published."""
        for page in reversed(pages):
            self.refs[page] -= 1
            if self.refs[page] == 0:
                if page in self.hash_of:
                    self.idle[page] = None
                else:
                    self.free.append(page)

    def clear_prefix_cache(self) -> None:
        for page in self.idle:
            del self.by_hash[self.hash_of.pop(page)]
            if page in self.sink_copy:
                self._drop_copy(self.sink_copy.pop(page))
            self.free.append(page)
        self.idle.clear()
