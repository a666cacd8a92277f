"""Compressed KV caches: quality, size and speed. Perplexity of SmolLM2 over a fixed text (Python's own
reference documentation, pydoc_data, the first `--tokens` tokens) with each cache kind, in one process,
and llama.cpp's own q8_0/q4_0 caches (type_k/type_v, flash attention; it rotates quantized caches) over
the same token ids as the peer; bytes per token for each. The f16 rows of both engines anchor the
comparison. q8 activations (the GGUF default, as llama.cpp) round each matmul's input, so a change far
below a codec's error moves the perplexity by up to about 1%; --exact adds a pass with f32 activations,
which ranks the kinds without that noise (each against its own f16). With --speed (a GPU): a random
Llama-3.2-1B-shape model's decode step at 4k, 16k and 64k tokens of context, f16 vs tq4 and tq3 caches,
the kinds alternating over rounds (median step time). With --quality, as users feel it: greedy
agreement with the f16 cache over PROMPTS (50 chat requests: instructions, summaries, code, lists, and
questions over a long document; the fraction whose first 64 generated tokens are identical, and the mean
index of the first difference), the perplexity, and a needle-in-a-haystack retrieval at 4k tokens, for
our kinds and llama.cpp's f16/q8_0/q4_0 caches on the same token ids.
Run: python bench/kv_cache.py [--tokens 3072] [--threads 2] [--device cpu|cuda] [--kinds f16;q8_0;...]
[--exact] [--speed] [--quality [--engines soma,llama]]; JSON goes to bench/out/kv-cache-<device>.json
(kv-speed-<device>.json with --speed, kv-quality-<device>.json with --quality, a row at a time: a run
goes on from the rows already there).
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np

OUT = Path(__file__).parent / "out"
KINDS = ("f16", "q8_0", "q4_0", "tq4", "tq3", "tq2", "tq4/tq2", "tq3j", "tq2j", "kv4", "kv3")
QUALITY_KINDS = ("f16", "q8_0", "q4_0", "tq4", "tq3", "kv4", "kv3")
LLAMA_KINDS = {"f16": 1, "q8_0": 8, "q4_0": 2}          # GGML type numbers


def text() -> str:
    from pydoc_data.topics import topics
    return "\n\n".join(topics[name] for name in sorted(topics))


def perplexity(logits: np.ndarray, ids: list[int]) -> float:
    """exp of the mean negative log-likelihood of each token after the first, given those before it."""
    logits = logits[:-1].astype(np.float64)
    top = logits.max(axis=1, keepdims=True)
    log_z = (top[:, 0] + np.log(np.exp(logits - top).sum(axis=1)))
    return float(np.exp(np.mean(log_z - logits[np.arange(len(ids) - 1), ids[1:]])))


def ours(path: str, ids: list[int], kinds, device: str, threads: int, activations: str | None = None) -> dict:
    from soma_runtime.tasks import Runtime
    runtime = Runtime(device, threads=threads)
    results = {}
    for kind in kinds:
        model = runtime.load(path, kv_dtype=kind, n_ctx=len(ids) + 16, progress=False, activations=activations)
        start = time.perf_counter()
        ppl = perplexity(model.logits(ids), ids)
        results[kind] = {"perplexity": ppl, "bytes_per_token": model.engine.cache.token_bytes(),
                         "seconds": time.perf_counter() - start}
        print(f"soma  {kind:10s} ppl {ppl:8.4f}  {results[kind]['bytes_per_token']:6d} B/token  "
              f"({results[kind]['seconds']:.1f} s)", flush=True)
        runtime.unload(model.id)
    return results


def llama(path: str, ids: list[int], threads: int) -> dict:
    from llama_cpp import Llama
    results = {}
    for kind, ggml in LLAMA_KINDS.items():
        llm = Llama(path, n_ctx=len(ids) + 16, n_batch=512, n_threads=threads, type_k=ggml, type_v=ggml, flash_attn=True,
                    logits_all=True, verbose=False)
        llm.eval(ids)
        ppl = perplexity(np.asarray(llm.scores[:len(ids)]), ids)
        results[kind] = {"perplexity": ppl}
        print(f"llama {kind:10s} ppl {ppl:8.4f}", flush=True)
        del llm
    return results


# --- quality as users feel it ---------------------------------------------------------------------------

GENERATED = 64            # tokens compared
PROMPTS = [
    # instructions
    "Write a short note to a neighbour asking them to water my plants while I am away for a week.",
    "Explain how to boil an egg so that the yolk stays soft.",
    "Give me three tips for sleeping better.",
    "How do I change a flat tyre on a bicycle?",
    "Describe how to make a cup of green tea.",
    "What should I pack for a two-day hiking trip?",
    "Write a polite email declining an invitation to a meeting on Friday.",
    "Explain to a child why the sky is blue.",
    "How can I improve my handwriting?",
    "Suggest a name for a small bakery that sells bread and cakes.",
    # summaries
    "Summarize: The committee met on Tuesday. The committee approved the budget. The committee adjourned at noon.",
    ("Summarize in one sentence: The train left the station at eight. It was delayed by snow near the mountains and "
    "arrived in the city three hours late, where the passengers were given free meals."),
    ("Summarize: Bees collect nectar from flowers and turn it into honey. While doing so they carry pollen from plant "
    "to plant, which helps the plants make seeds. Many crops depend on this."),
    ("Summarize this review: The hotel was clean and the staff were friendly, but the room was small and the street "
    "outside was noisy all night. Breakfast was excellent."),
    ("Summarize: Water boils at 100 degrees Celsius at sea level. At higher altitudes the air pressure is lower, so "
    "water boils at a lower temperature, and food takes longer to cook."),
    ("Give a one-line summary: The library will close for renovation from March to June. Books can be returned at "
    "the town hall during that time, and the online catalogue stays open."),
    ("Summarize: Anna planted tomatoes in April. She watered them every evening. By August the plants were taller "
    "than her and she gave baskets of tomatoes to her friends."),
    ("Summarize the main point: Regular exercise strengthens the heart, improves mood, and helps people sleep. Even a "
    "short walk each day has measurable benefits."),
    "Summarize: The company sold 120 bicycles in January, 150 in February and 210 in March, its best month so far.",
    "Summarize: The meeting was moved from Monday to Wednesday because the manager was ill. The agenda is unchanged.",
    # code
    "Write a Python function that returns the largest of three numbers.",
    "Write a Python function to check whether a string is a palindrome.",
    "What does this code print?\n\nx = [1, 2, 3]\nprint(sum(x) * 2)",
    "Write a SQL query that selects all users older than 30 from a table named users.",
    "Explain what a for loop does in Python, with an example.",
    "Write a JavaScript function that adds two numbers.",
    "Fix the bug: def add(a, b): return a - b",
    "Write a Python list comprehension that squares the numbers from 1 to 10.",
    "What is the difference between a list and a tuple in Python?",
    "Write a bash command that counts the lines in a file named data.txt.",
    # lists
    "List five fruits that are red.",
    "Name four planets of the solar system.",
    "List three ways to save water at home.",
    "Give me a list of five common pets.",
    "List the days of the week.",
    "Name five countries in Europe.",
    "List four things you need to bake bread.",
    "Give three examples of renewable energy.",
    "List five colours of the rainbow.",
    "Name three musical instruments with strings.",
    # questions
    "What is the capital of France?",
    "How many legs does a spider have?",
    "Why do leaves change colour in autumn?",
    "What is photosynthesis?",
    "Who wrote Romeo and Juliet?",
]
DOCUMENT_TOPICS = ("try", "with", "for", "class", "import")      # a long document question each (pydoc_data)
NEEDLE = "The secret password of the blue door is PELICAN-7319."
NEEDLE_QUESTION = "What is the secret password of the blue door?"
NEEDLE_DEPTHS = (0.1, 0.5, 0.9)


def documents() -> list[str]:
    """Questions over a long document: a section of Python's reference, about 700 tokens each."""
    from pydoc_data.topics import topics
    return [f"Read this documentation and answer the question after it.\n\n{topics[name][:3000]}\n\n"
            f"Question: according to this text, what does the `{name}` statement do?" for name in DOCUMENT_TOPICS]


def haystack(tokens: int, depth: float, count) -> str:
    """About `tokens` tokens of Python's reference (from its end, apart from the perplexity text) with the
    needle at `depth` of it, then the question; `count` tokenizes."""
    words = text().split(" ")
    size = 200
    while count(" ".join(words[-size:])) < tokens:
        size += 200
    body = words[-size:]
    at = int(len(body) * depth)
    return " ".join(body[:at] + [NEEDLE] + body[at:]) + f"\n\n{NEEDLE_QUESTION}"


def chat_ids(model, message: str) -> list[int]:
    return model.tokenize(model.chat_prompt([{"role": "user", "content": message}]))


def greedy_ours(model, prompts: list[list[int]], tokens: int) -> list[list[int]]:
    """Each prompt's greedy tokens (up to `tokens`, or an end of sequence), all submitted at once."""
    import queue

    from soma_runtime.engine.generate.batching import Scheduler
    inbox, got = queue.Queue(), [[] for _ in prompts]
    scheduler = Scheduler(model.engine, max_batch=64, step_tokens=1024, thread=True)
    try:
        for i, ids in enumerate(prompts):
            scheduler.submit(model.request(ids, tokens, stop=[], temperature=0), lambda item, i=i: inbox.put((i, item)))
        done = 0
        while done < len(prompts):
            i, item = inbox.get(timeout=3600)
            if isinstance(item, Exception):
                raise item
            done += item is None
            if item is not None and item.id not in model.engine.stop_ids:
                got[i].append(item.id)
    finally:
        scheduler.close()
    return got


def greedy_llama(llm, prompts: list[list[int]], tokens: int, stops: set[int]) -> list[list[int]]:
    out = []
    for ids in prompts:
        llm.reset()
        llm.eval(ids)
        got = []
        while len(got) < tokens:
            token = int(np.argmax(np.ctypeslib.as_array(llm._ctx.get_logits_ith(-1), shape=(llm.n_vocab(),))))
            if token in stops:
                break
            got.append(token)
            llm.eval([token])
        out.append(got)
    return out


def agreement(reference: list[list[int]], other: list[list[int]]) -> dict:
    """The fraction of prompts whose generated tokens equal the reference's, and the mean index of the
    first difference (a prompt that agrees throughout counts its length)."""
    firsts = []
    for a, b in zip(reference, other):
        first = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        firsts.append(max(len(a), len(b)) if a == b else first)
    return {"identical": float(np.mean([a == b for a, b in zip(reference, other)])), "first_difference": float(np.mean(firsts))}


def quality(kinds, tokens: int, threads: int, engines: tuple[str, ...], path_out: Path) -> dict:
    """Ours and llama.cpp's caches on the same token ids: greedy agreement with each engine's f16 cache
    over PROMPTS and the documents, perplexity over `tokens` tokens, needle retrieval at 4k tokens. Each
    kind's row is written to `path_out` as it is measured; rows already there are kept, not measured again."""
    from soma_runtime.loaders import resolve
    from soma_runtime.tasks import Runtime
    path = resolve("default")
    runtime = Runtime("cpu", threads=threads)
    base = runtime.load(path, progress=False, n_ctx=4608)
    prompts = [chat_ids(base, p) for p in PROMPTS + documents()]
    ids = base.tokenize(text())[:tokens]
    count = lambda t: len(base.tokenize(t))
    needles = [chat_ids(base, haystack(4000, depth, count)) for depth in NEEDLE_DEPTHS]
    stops = set(base.engine.stop_ids)
    results = {"model": path, "prompts": len(prompts), "generated": GENERATED, "perplexity_tokens": len(ids),
               "needle_tokens": [len(n) for n in needles], "threads": threads, "soma": {}, "llama.cpp": {}}
    if path_out.exists():
        results.update({k: v for k, v in json.loads(path_out.read_text()).items() if k in ("soma", "llama.cpp")})

    def keep(engine: str, kind: str, row: dict, answers: list, detokenize) -> None:
        row["needle"] = [NEEDLE.split()[-1].rstrip(".") in detokenize(a) for a in answers]
        row["needle_answers"] = [detokenize(a) for a in answers]
        results[engine][kind] = row
        path_out.write_text(json.dumps(results, indent=2))
        print(f"{engine:9s} {kind:24s} ppl {row['perplexity']:8.4f}  needle {sum(row['needle'])}/{len(needles)}  "
              f"({row['seconds']:.0f} s)", flush=True)

    for kind in kinds if "soma" in engines else ():
        if kind in results["soma"]:
            continue
        start = time.perf_counter()
        model = runtime.load(path, kv_dtype=kind, n_ctx=4608, progress=False)
        row = {"bytes_per_token": model.engine.cache.token_bytes(), "perplexity": perplexity(model.logits(ids), ids),
               "greedy": greedy_ours(model, prompts, GENERATED)}
        answers = greedy_ours(model, needles, 24)
        row["seconds"] = time.perf_counter() - start
        keep("soma", kind, row, answers, model.detokenize)
        runtime.unload(model.id)
    if "llama" in engines:
        from llama_cpp import Llama
        for kind, ggml in LLAMA_KINDS.items():
            if kind in results["llama.cpp"]:
                continue
            start = time.perf_counter()
            options = {"n_batch": 512, "n_threads": threads, "type_k": ggml, "type_v": ggml, "flash_attn": True, "verbose": False}
            llm = Llama(path, n_ctx=len(ids) + 16, logits_all=True, **options)
            llm.eval(ids)
            row = {"perplexity": perplexity(np.asarray(llm.scores[:len(ids)]), ids)}
            del llm
            llm = Llama(path, n_ctx=4608, **options)
            row["greedy"] = greedy_llama(llm, prompts, GENERATED, stops)
            answers = greedy_llama(llm, needles, 24, stops)
            row["seconds"] = time.perf_counter() - start
            del llm
            keep("llama.cpp", kind, row, answers, base.detokenize)
    for engine in ("soma", "llama.cpp"):
        rows = results[engine]
        if "f16" not in rows:
            continue
        for kind, row in rows.items():
            row.update(agreement(rows["f16"]["greedy"], row["greedy"]))
            row["vs_f16_perplexity"] = row["perplexity"] / rows["f16"]["perplexity"] - 1
            print(f"{engine:9s} {kind:24s} identical {row['identical']:5.1%}  first difference {row['first_difference']:5.1f}  "
                  f"ppl {row['vs_f16_perplexity']:+.2%}  needle {sum(row['needle'])}/{len(row['needle'])}", flush=True)
    path_out.write_text(json.dumps(results, indent=2))
    return results


SPEED_KINDS, CONTEXTS, STEPS = ("f16", "tq4", "tq3"), (4096, 16384, 65536), 64


def decode_step_seconds(model, context: int) -> float:
    """Median time of one greedy decode step of a sequence whose cache holds `context` tokens (their
    values do not matter: attention reads them all the same)."""
    import statistics

    from soma_runtime.engine.generate.sampling import greedy_rows
    from soma_runtime.engine.kv import Sequence
    engine, seq = model.engine, Sequence()
    engine.pool.reserve(seq, context + 1)
    try:
        times = []
        for _ in range(STEPS):
            seq.length = context
            start = time.perf_counter()
            engine.forward([(seq, [1], 1)], greedy_rows(1))
            times.append(time.perf_counter() - start)
        return statistics.median(times[STEPS // 4:])
    finally:
        engine.pool.release(seq)


def speed(device: str, rounds: int) -> dict:
    import sys
    import tempfile
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from llm_cuda import SHAPES

    from soma_runtime.tasks import Runtime
    from tests.fixtures.decoders import random_llama
    directory = tempfile.mkdtemp(prefix="kv-speed-")
    random_llama({**SHAPES["1b"], "max_position_embeddings": 2 * CONTEXTS[-1]}, directory, device=device)
    runtime = Runtime(device)
    models = {kind: runtime.load(directory, kv_dtype=kind, n_ctx=CONTEXTS[-1] + 16, progress=False) for kind in SPEED_KINDS}
    times = {(kind, n): [] for kind in SPEED_KINDS for n in CONTEXTS}
    for _ in range(rounds):
        for n in CONTEXTS:
            for kind, model in models.items():
                times[kind, n].append(decode_step_seconds(model, n))
    results = {}
    for n in CONTEXTS:
        base = float(np.median(times["f16", n]))
        for kind, model in models.items():
            t = float(np.median(times[kind, n]))
            cache_gb = model.engine.cache.token_bytes() * n / 1e9
            results[f"{kind}@{n}"] = {"step_ms": t * 1e3, "tok_s": 1 / t, "vs_f16": base / t, "cache_gb": cache_gb}
            print(f"{kind:5s} context {n:6d}: {t * 1e3:7.3f} ms/token  {1 / t:7.1f} tok/s  {base / t:5.2f}x f16  "
                  f"cache read {cache_gb:.2f} GB", flush=True)
    return results


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=3072)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    ap.add_argument("--kinds", default=None, help="our kinds, ';'-separated (a spec may hold commas)")
    ap.add_argument("--no-llama", action="store_true")
    ap.add_argument("--exact", action="store_true", help="also our kinds with f32 activations")
    ap.add_argument("--speed", action="store_true")
    ap.add_argument("--quality", action="store_true", help="greedy agreement, perplexity and needle retrieval")
    ap.add_argument("--engines", default="soma,llama", help="with --quality: whose caches (rows already measured are kept)")
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    if args.quality:
        kinds = QUALITY_KINDS if args.kinds is None else args.kinds.split(";")
        OUT.mkdir(exist_ok=True)
        engines = tuple(args.engines.split(","))
        engines = ("soma",) if args.no_llama else engines
        quality(kinds, args.tokens, args.threads, engines, OUT / f"kv-quality-{args.device}.json")
        print(f"wrote {OUT / f'kv-quality-{args.device}.json'}")
        return
    args.kinds = ";".join(KINDS) if args.kinds is None else args.kinds
    if args.speed:
        results = speed(args.device, args.rounds)
        OUT.mkdir(exist_ok=True)
        (OUT / f"kv-speed-{args.device}.json").write_text(json.dumps({"device": args.device, "results": results}, indent=2))
        return
    from soma_runtime.loaders import resolve
    path = resolve("default")
    from soma_runtime.tasks import Runtime
    ids = Runtime("cpu").load(path, progress=False).tokenize(text())[:args.tokens]
    results = {"soma": ours(path, ids, args.kinds.split(";"), args.device, args.threads)}
    if not args.no_llama:
        results["llama.cpp"] = llama(path, ids, args.threads)
    if args.exact:
        results["soma f32 activations"] = ours(path, ids, args.kinds.split(";"), args.device, args.threads, "f32")
    if "f16" in results["soma"]:
        for engine, rs in results.items():
            base = results["soma f32 activations" if engine == "soma f32 activations" else "soma"]["f16"]["perplexity"]
            for r in rs.values():
                r["vs_soma_f16"] = r["perplexity"] / base - 1
        print("vs our f16: " + ", ".join(f"{e}/{k} {r['vs_soma_f16']:+.2%}" for e, rs in results.items() for k, r in rs.items()))
    OUT.mkdir(exist_ok=True)
    path = OUT / f"kv-cache-{args.device}.json"
    path.write_text(json.dumps({"tokens": len(ids), "device": args.device, "threads": args.threads, "results": results},
                               indent=2))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
