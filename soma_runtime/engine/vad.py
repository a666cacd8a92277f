"""Voice activity: the Silero VAD graph run through the runtime 32 ms at a time (512 samples at 16 kHz,
after the previous chunk's last 64), its recurrent state carried from chunk to chunk; and its speech
probabilities turned into speech segments as silero-vad's get_speech_timestamps turns them: speech
starts at a chunk at or above `threshold` and ends once the probability has stayed below `neg_threshold`
for `min_silence_ms`; segments not longer than `min_speech_ms` are dropped; each is widened by
`speech_pad_ms` on both sides (neighbours closer than twice that meet halfway). Segments may run any
length: the caller cuts them to its window."""
from __future__ import annotations

import numpy as np

from soma_runtime.errors import RequestError

RATE, CHUNK, CONTEXT = 16000, 512, 64


class VoiceActivity:
    """A loaded Silero VAD graph (inputs `input` [1, 576], `state` [2, 1, 128], `sr`; outputs the speech
    probability and the next state)."""

    def __init__(self, model):
        if set(model.inputs) != {"input", "state", "sr"}:
            raise RequestError(f"{model.id} is not a Silero VAD graph: its inputs are {sorted(model.inputs)}")
        self.model = model
        self.outputs = list(model.outputs)

    def probabilities(self, audio: np.ndarray) -> np.ndarray:
        """Speech probability per 512-sample chunk of 16 kHz mono `audio` (the last chunk padded with silence)."""
        audio = np.asarray(audio, np.float32)
        if audio.ndim != 1:
            raise RequestError(f"audio must be mono samples [n], got shape {list(audio.shape)}")
        padded = np.concatenate([np.zeros(CONTEXT, np.float32), audio, np.zeros(-len(audio) % CHUNK, np.float32)])
        state, probs = np.zeros((2, 1, 128), np.float32), []
        for start in range(0, len(padded) - CONTEXT, CHUNK):
            out = self.model.run({"input": padded[None, start:start + CONTEXT + CHUNK], "state": state,
                                  "sr": np.array(RATE, np.int64)})
            probs.append(float(out[self.outputs[0]].reshape(-1)[0]))
            state = out[self.outputs[1]]
        return np.array(probs, np.float32)

    def segments(self, audio: np.ndarray, **options) -> list[tuple[int, int]]:
        """Speech segments of `audio` as (first sample, end sample)."""
        return speech_segments(self.probabilities(audio), len(audio), **options)


def speech_segments(probs, total: int, threshold: float = 0.5, neg_threshold: float | None = None,
                    min_speech_ms: int = 250, min_silence_ms: int = 100, speech_pad_ms: int = 30) -> list[tuple[int, int]]:
    """(start, end) samples of the speech in audio of `total` samples whose chunks have probabilities `probs`."""
    off = max(threshold - 0.15, 0.01) if neg_threshold is None else neg_threshold
    min_speech, min_silence, pad = RATE * min_speech_ms / 1000, RATE * min_silence_ms / 1000, RATE * speech_pad_ms / 1000
    found, start, quiet_since = [], None, None
    for i, p in enumerate(probs):
        at = i * CHUNK
        if p >= threshold:
            quiet_since = None
            start = at if start is None else start
        elif p < off and start is not None:
            quiet_since = at if quiet_since is None else quiet_since
            if at - quiet_since >= min_silence:
                if quiet_since - start > min_speech:
                    found.append([start, quiet_since])
                start = quiet_since = None
    if start is not None and total - start > min_speech:
        found.append([start, total])
    for i, seg in enumerate(found):                 # padding: halfway into gaps narrower than two pads
        if i == 0:
            seg[0] = int(max(0, seg[0] - pad))
        if i + 1 < len(found):
            gap = found[i + 1][0] - seg[1]
            widen = gap // 2 if gap < 2 * pad else pad
            seg[1] = int(min(total, seg[1] + widen))
            found[i + 1][0] = int(max(0, found[i + 1][0] - widen))
        else:
            seg[1] = int(min(total, seg[1] + pad))
    return [(a, b) for a, b in found]
