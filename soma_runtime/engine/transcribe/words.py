"""Word timestamps as faster-whisper finds them (CTranslate2's `align`): the window's text run once more
through a decoder that also gives the raw cross-attention scores of the model's alignment heads; those
softmaxed over the window's frames, normalized across tokens, median-filtered (width 7) along time and
averaged over the heads; dynamic time warping through their negative gives each token its frame; words
(tokens split at spaces and punctuation) take the times where their first and next word's tokens start,
then long words at sentence and segment boundaries are cut back and punctuation joins its neighbour.
Knows decoding results and alignment, nothing of the search."""
from __future__ import annotations

import string

import numpy as np
from numba import njit

from soma_runtime.architectures.weights import Weights
from soma_runtime.architectures.whisper import WhisperConfig, build_decoder
from soma_runtime.engine.graph import GraphRunner
from soma_runtime.engine.transcribe.tokens import WhisperTokens
from soma_runtime.ir.backend import Backend

MEDIAN_WIDTH = 7
TOKENS_PER_SECOND = 50                     # encoder positions per second of audio
PREPEND = "\"'“¿([{-"
APPEND = "\"'.。,，!！?？:：”)]}、"
SENTENCE_ENDS = ".。!！?？"


class Aligner:
    def __init__(self, cfg: WhisperConfig, weights: Weights, backend: Backend, heads: list[tuple[int, int]]):
        self.heads = sorted((int(layer), int(head)) for layer, head in heads)
        self.runner = GraphRunner(build_decoder(cfg, weights, tuple(self.heads)), backend)

    def align(self, encoded: np.ndarray, start: list[int], text: list[int], frames: int, tok: WhisperTokens):
        """([(token index, frame)] DTW path, each text token's probability) for one window's text."""
        ids = [*start, tok.no_timestamps, *text, tok.eot]
        out = self.runner.run({"ids": np.asarray([ids], np.int64), "positions": np.arange(len(ids))[None],
                               "encoded": encoded[None]})
        logits, scores = (np.asarray(v, np.float32) for v in out.values())
        text_logits = logits[0, :, :tok.eot]
        probs = np.exp(text_logits - text_logits.max(axis=-1, keepdims=True))
        probs /= probs.sum(axis=-1, keepdims=True)
        following = ids[1:] + [0]
        offset = len(start)
        token_probs = [float(probs[offset + t, following[offset + t]]) for t in range(len(text))]
        frames //= 2
        if frames == 0:
            return [], token_probs
        weights = scores[0, :, :, :frames]
        weights = np.exp(weights - weights.max(axis=-1, keepdims=True))
        weights /= weights.sum(axis=-1, keepdims=True)
        weights = (weights - weights.mean(axis=-2, keepdims=True)) / weights.std(axis=-2, keepdims=True)
        matrix = median_filter(weights, MEDIAN_WIDTH).mean(axis=0)[offset: offset + len(text) + 1]
        return negative_dtw(np.ascontiguousarray(matrix, np.float32)), token_probs


def median_filter(x: np.ndarray, width: int) -> np.ndarray:
    """Median over `width` along the last axis, reflected at the edges (without repeating them)."""
    rank = width // 2
    if x.shape[-1] <= rank:
        return x
    padded = np.pad(x, [(0, 0)] * (x.ndim - 1) + [(rank, rank)], mode="reflect")
    return np.median(np.lib.stride_tricks.sliding_window_view(padded, width, axis=-1), axis=-1).astype(np.float32)


@njit(cache=True)
def _dtw_trace(x):
    n, m = x.shape
    cost = np.full((n + 1, m + 1), np.inf, np.float32)
    trace = np.full((n + 1, m + 1), -1, np.int32)
    cost[0, 0] = 0
    for j in range(1, m + 1):
        for i in range(1, n + 1):
            c0, c1, c2 = cost[i - 1, j - 1], cost[i - 1, j], cost[i, j - 1]
            if c0 < c1 and c0 < c2:
                c, t = c0, 0
            elif c1 < c0 and c1 < c2:
                c, t = c1, 1
            else:
                c, t = c2, 2
            cost[i, j] = -x[i - 1, j - 1] + c
            trace[i, j] = t
    return trace


def negative_dtw(x: np.ndarray) -> list[tuple[int, int]]:
    """The cheapest monotonic path through -x, as (row, column) pairs."""
    trace = _dtw_trace(x)
    i, j = x.shape
    trace[0, :] = 2
    trace[:, 0] = 1
    path = []
    while i > 0 or j > 0:
        path.append((i - 1, j - 1))
        t = trace[i, j]
        i, j = (i - 1, j - 1) if t == 0 else (i - 1, j) if t == 1 else (i, j - 1)
    return path[::-1]


def split_words(tok: WhisperTokens, tokens: list[int]) -> tuple[list[str], list[list[int]]]:
    """Tokens grouped into words: at whole characters, then joined unless a piece starts with a space,
    is punctuation or a special token."""
    full = decode_with_timestamps(tok, tokens)
    pieces, piece_tokens, current, offset = [], [], [], 0
    for token in tokens:
        current.append(token)
        decoded = decode_with_timestamps(tok, current)
        broken = decoded.find("\ufffd")
        if broken < 0 or (broken + offset < len(full) and full[broken + offset] == "\ufffd"):
            pieces.append(decoded)
            piece_tokens.append(current)
            current, offset = [], offset + len(decoded)
    words, word_tokens = [], []
    for piece, group in zip(pieces, piece_tokens):
        if group[0] >= tok.eot or piece.startswith(" ") or piece.strip() in string.punctuation or not words:
            words.append(piece)
            word_tokens.append(group)
        else:
            words[-1] += piece
            word_tokens[-1].extend(group)
    return words, word_tokens


def decode_with_timestamps(tok: WhisperTokens, tokens: list[int]) -> str:
    out, run = [], []
    for token in tokens:
        if token >= tok.timestamp_begin:
            out += [tok.tokenizer.hf.decode(run), f"<|{(token - tok.timestamp_begin) * 0.02:.2f}|>"]
            run = []
        else:
            run.append(token)
    return "".join(out) + tok.tokenizer.hf.decode(run)


def word_timings(aligner: Aligner, tok: WhisperTokens, encoded: np.ndarray, start: list[int], text: list[int],
                 frames: int) -> list[dict]:
    """Each word of `text` with its start, end (seconds into the window), tokens and mean probability."""
    if not text:
        return []
    path, probs = aligner.align(encoded, start, text, frames, tok)
    words, word_tokens = split_words(tok, text + [tok.eot])
    if len(word_tokens) <= 1 or not path:
        return []
    rows, cols = np.array([p[0] for p in path]), np.array([p[1] for p in path])
    bounds = np.pad(np.cumsum([len(t) for t in word_tokens[:-1]]), (1, 0))
    jumps = np.pad(np.diff(rows), (1, 0), constant_values=1).astype(bool)
    times = cols[jumps] / TOKENS_PER_SECOND
    return [{"word": w, "tokens": t, "start": float(times[a]), "end": float(times[b]), "probability": float(np.mean(probs[a:b]))}
            for w, t, a, b in zip(words, word_tokens, bounds[:-1], bounds[1:])]


def merge_punctuations(alignment: list[dict], prepended: str = PREPEND, appended: str = APPEND) -> None:
    """Opening punctuation joins the word after it, closing punctuation the word before it."""
    i, j = len(alignment) - 2, len(alignment) - 1
    while i >= 0:
        previous, following = alignment[i], alignment[j]
        if previous["word"].startswith(" ") and previous["word"].strip() in prepended:
            following["word"] = previous["word"] + following["word"]
            following["tokens"] = previous["tokens"] + following["tokens"]
            previous["word"], previous["tokens"] = "", []
        else:
            j = i
        i -= 1
    i, j = 0, 1
    while j < len(alignment):
        previous, following = alignment[i], alignment[j]
        if not previous["word"].endswith(" ") and following["word"] in appended:
            previous["word"] = previous["word"] + following["word"]
            previous["tokens"] = previous["tokens"] + following["tokens"]
            following["word"], following["tokens"] = "", []
        else:
            i = j
        j += 1


def add_word_timestamps(pieces: list[dict], alignment: list[dict], time_offset: float, last_speech: float, eot: int) -> float:
    """Give each segment piece (start, end, tokens) its words, trimming words that run long at sentence
    and segment boundaries as faster-whisper does; the pieces' ends move to their words'. Returns the
    time the last word ends (or `last_speech`)."""
    durations = np.array([w["end"] - w["start"] for w in alignment])
    durations = durations[durations.nonzero()]
    median = min(0.7, float(np.median(durations)) if len(durations) else 0.0)
    longest = median * 2
    if len(durations):
        for i in range(1, len(alignment)):
            if alignment[i]["end"] - alignment[i]["start"] > longest:
                if alignment[i]["word"] in SENTENCE_ENDS:
                    alignment[i]["end"] = alignment[i]["start"] + longest
                elif alignment[i - 1]["word"] in SENTENCE_ENDS:
                    alignment[i]["start"] = alignment[i]["end"] - longest
    merge_punctuations(alignment)
    index = 0
    for piece in pieces:
        saved, words = 0, []
        text_count = len([t for t in piece["tokens"] if t < eot])
        while index < len(alignment) and saved < text_count:
            timing = alignment[index]
            if timing["word"]:
                words.append({"word": timing["word"], "start": round(time_offset + timing["start"], 2),
                              "end": round(time_offset + timing["end"], 2), "probability": timing["probability"]})
            saved += len(timing["tokens"])
            index += 1
        if words:
            trim_edges(words, piece, median, longest, last_speech)
            last_speech = piece["end"]
        piece["words"] = words
    return last_speech


def trim_edges(words: list[dict], piece: dict, median: float, longest: float, last_speech: float) -> None:
    """A first word after a pause and a segment's first and last words no longer than the timing suggests."""
    first = words[0]
    if first["end"] - last_speech > median * 4 and (
            first["end"] - first["start"] > longest or (len(words) > 1 and words[1]["end"] - first["start"] > longest * 2)):
        if len(words) > 1 and words[1]["end"] - words[1]["start"] > longest:
            boundary = max(words[1]["end"] / 2, words[1]["end"] - longest)
            first["end"] = words[1]["start"] = boundary
        first["start"] = max(0, first["end"] - longest)
    if piece["start"] < first["end"] and piece["start"] - 0.5 > first["start"]:
        first["start"] = max(0, min(first["end"] - median, piece["start"]))
    else:
        piece["start"] = first["start"]
    last = words[-1]
    if piece["end"] > last["start"] and piece["end"] + 0.5 < last["end"]:
        last["end"] = max(last["start"] + median, piece["end"])
    else:
        piece["end"] = last["end"]


def words_end(pieces: list[dict]) -> float | None:
    """When the last word of the pieces ends (the last piece's end where none has words)."""
    return next((w["end"] for p in reversed(pieces) for w in reversed(p["words"])), pieces[-1]["end"] if pieces else None)
