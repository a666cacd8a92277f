"""LoRA adapters at run time against PEFT (transformers + peft) in the same run: a tiny random Llama base
with random adapters of several ranks and targets (rsLoRA, DoRA, rank and alpha patterns, a regex). Each
adapter's logits equal PEFT's; a batch mixing adapters and base rows gives each row its solo output; the
merged weights (PEFT's merge_and_unload) give the same logits; bad adapters are ModelLoadErrors naming
what is wrong, and the model runs on after them."""
from __future__ import annotations

import json
import os
import shutil

import numpy as np
import pytest
import torch
from safetensors.numpy import load_file, save_file

from soma_runtime.errors import ModelLoadError, RequestError, UnsupportedModelError
from soma_runtime.tasks import Runtime
from tests.backends import BACKENDS
from tests.fixtures.adapters import make_adapter
from tests.fixtures.decoders import build_model

PROMPT = "The quick brown fox jumps over the lazy dog. Hello world 123!"
TOL = 1e-4           # of the logits' scale, as the families' test against transformers

ADAPTERS = {         # name -> LoraConfig arguments: ranks 2 to 16, attention only to every linear layer
    "qv-r4": {"r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj"]},
    "all-r8-rslora": {"r": 8, "lora_alpha": 16, "use_rslora": True,
                      "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]},
    "mlp-r16": {"r": 16, "lora_alpha": 4, "target_modules": ["gate_proj", "up_proj", "down_proj"]},
    "regex-r2": {"r": 2, "lora_alpha": 3, "target_modules": r".*\.1\.self_attn\.(o_proj|k_proj)"},
    "patterns": {"r": 4, "lora_alpha": 4, "target_modules": ["q_proj", "down_proj"], "rank_pattern": {"down_proj": 6},
                 "alpha_pattern": {"q_proj": 12}},
    "dora-r4": {"r": 4, "lora_alpha": 8, "use_dora": True, "target_modules": ["q_proj", "v_proj", "down_proj"]},
}


@pytest.fixture(scope="module")
def lora_setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora")
    base_dir = str(root / "base")
    base, tok = build_model("llama", base_dir)
    peft_models = {name: make_adapter(base, cfg, str(root / name), seed) for seed, (name, cfg) in enumerate(ADAPTERS.items())}
    ours = Runtime(backend="cpu").load(base_dir, progress=False, kv_dtype="f32", activations="f32")
    for name in ADAPTERS:
        ours.load_lora(str(root / name))
    return root, base, tok, peft_models, ours


def close(got, want, what: str) -> None:
    scale = max(1.0, float(np.abs(want).max()))
    err = float(np.max(np.abs(got - want)))
    assert err <= TOL * scale, f"{what}: max logit error {err:.3g} > {TOL * scale:.3g}"


def reference_logits(model, ids: list[int]) -> np.ndarray:
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].float().numpy()


@pytest.mark.parametrize("name", sorted(ADAPTERS))
def test_each_adapters_logits_equal_pefts(lora_setup, name):
    _, base, tok, peft_models, ours = lora_setup
    ids = tok.encode(PROMPT).ids
    want = reference_logits(peft_models[name], ids)
    assert np.abs(want - reference_logits(base, ids)).max() > 0.05, "the adapter changes nothing"
    close(ours.logits(ids, lora=name), want, name)


def test_base_rows_are_the_base_models_with_adapters_loaded(lora_setup):
    _, base, tok, _, ours = lora_setup
    ids = tok.encode(PROMPT).ids
    close(ours.logits(ids), reference_logits(base, ids), "base")


EXTRA = {"qv-r4-half": ("qv-r4", 0.5), "mlp-r16-double": ("mlp-r16", 2.0)}     # 8 adapters in all: two loaded twice


@pytest.fixture(scope="module")
def eight(lora_setup):
    root, _, tok, _, ours = lora_setup
    for name, (source, alpha) in EXTRA.items():
        if name not in {x["name"] for x in ours.list_loras()}:
            ours.load_lora(str(root / source), alpha=alpha, name=name)
    return tok, ours


def test_alpha_scales_the_update(eight, lora_setup, tmp_path):
    """An adapter loaded at alpha 0.5 (or run at a request's scale 0.5) is PEFT's with half its lora_alpha;
    DoRA's too (loaded at 0.5: its magnitudes are made for that strength)."""
    import copy

    from peft import PeftModel
    root, base, tok, _, ours = lora_setup
    ids = tok.encode(PROMPT).ids
    halved = rewrite(root / "qv-r4", tmp_path / "halved", {"lora_alpha": ADAPTERS["qv-r4"]["lora_alpha"] / 2})
    want = reference_logits(PeftModel.from_pretrained(copy.deepcopy(base), halved).eval(), ids)
    close(ours.logits(ids, lora="qv-r4-half"), want, "qv-r4 at alpha 0.5")
    close(ours.logits(ids, lora="qv-r4", lora_scale=0.5), want, "qv-r4 at a request's scale 0.5")
    dora = rewrite(root / "dora-r4", tmp_path / "dora-halved", {"lora_alpha": ADAPTERS["dora-r4"]["lora_alpha"] / 2})
    want = reference_logits(PeftModel.from_pretrained(copy.deepcopy(base), dora).eval(), ids)
    single = Runtime(backend="cpu").load(str(root / "base"), progress=False, kv_dtype="f32", activations="f32")
    single.load_lora(str(root / "dora-r4"), alpha=0.5)
    close(single.logits(ids, lora="dora-r4"), want, "dora-r4 at alpha 0.5")


def test_a_batch_mixing_eight_adapters_and_base_rows_gives_each_row_its_solo_output(eight):
    from soma_runtime.engine.kv import Sequence
    tok, ours = eight
    engine = ours.engine
    names = [x["name"] for x in ours.list_loras()]
    assert len(names) == 8
    prompts = [tok.encode(f"{PROMPT} {i}" * (1 + i % 3)).ids for i in range(len(names) + 2)]
    choices = [*names, None, None]                       # two rows of the base among them
    solo = [ours.logits(ids, lora=name) for ids, name in zip(prompts, choices)]
    seqs = [Sequence(variant=engine.variant(name)) for name in choices]
    try:
        batched = engine.forward([(seq, ids, len(ids)) for seq, ids in zip(seqs, prompts)])
        for got, want, name in zip(batched, solo, choices):
            close(got, want, f"{name or 'base'} in a mixed prompt batch")
        steps = engine.forward([(seq, [int(np.argmax(logits[-1]))], 1) for seq, logits in zip(seqs, solo)])
    finally:
        for seq in seqs:
            engine.release(seq)
    for ids, logits, name, got in zip(prompts, solo, choices, steps):
        want = ours.logits(ids + [int(np.argmax(logits[-1]))], lora=name)[-1:]
        close(got, want, f"{name or 'base'} in a mixed decode step")


def test_streams_generated_together_under_different_adapters_match_their_solo_runs(eight):
    tok, ours = eight
    ids = tok.encode(PROMPT).ids
    choices = ["qv-r4", "dora-r4", None, "mlp-r16-double", "all-r8-rslora"]
    solo = [[t.id for t in ours.generate(ids, max_tokens=12, temperature=0, ignore_eos=True, lora=name)] for name in choices]
    streams = [ours.generate(ids, max_tokens=12, temperature=0, ignore_eos=True, lora=name) for name in choices]
    together = [[] for _ in choices]
    for _ in range(12):                               # consumed side by side: the scheduler batches them
        for out, stream in zip(together, streams):
            out.append(next(stream).id)
    assert together == solo
    assert len({tuple(t) for t in solo}) > 2, "the adapters should change the greedy text"


def test_merged_weights_give_the_adapters_logits(lora_setup, tmp_path):
    """PEFT's merge_and_unload saved as a plain checkpoint, loaded as a model of its own: the same logits as
    the base running the adapter at run time."""
    root, _, tok, peft_models, ours = lora_setup
    ids = tok.encode(PROMPT).ids
    for name in ("all-r8-rslora", "dora-r4"):
        merged_dir = tmp_path / name
        shutil.copytree(root / "base", merged_dir)
        import copy
        copy.deepcopy(peft_models[name]).merge_and_unload().save_pretrained(str(merged_dir))
        merged = Runtime(backend="cpu").load(str(merged_dir), progress=False, kv_dtype="f32", activations="f32")
        close(merged.logits(ids), ours.logits(ids, lora=name), f"{name} merged")


def test_a_prefix_cached_under_one_adapter_is_never_reused_under_another(eight):
    tok, ours = eight
    ids = tok.encode("Hello world, this is a tiny tokenizer for tests. " * 4).ids     # a prompt no other test runs
    assert len(ids) > 48
    ours.complete(ids, max_tokens=1, lora="qv-r4")
    ours.complete(ids, max_tokens=1, lora="qv-r4")
    assert ours.metrics()["cached_tokens"] >= 32, "the same adapter reuses its prefix"
    for name in ("dora-r4", None, "qv-r4-half"):
        got = [t.id for t in ours.generate(ids, max_tokens=4, temperature=0, ignore_eos=True, lora=name)]
        assert ours.metrics()["cached_tokens"] == 0, f"{name or 'base'} reused qv-r4's prefix"
        want = np.argmax(ours.logits(ids, lora=name)[-1])
        assert got[0] == want
    ours.complete(ids, max_tokens=1, lora="qv-r4", lora_scale=0.5)
    assert ours.metrics()["cached_tokens"] == 0, "another scale is another variant"


def rewrite(source, target, config=None, tensors=None) -> str:
    """A copy of adapter directory `source` with its config updated by `config` and tensors by `tensors`
    (a function of the tensor dict)."""
    shutil.copytree(source, target)
    with open(os.path.join(target, "adapter_config.json")) as f:
        cfg = json.load(f)
    with open(os.path.join(target, "adapter_config.json"), "w") as f:
        json.dump({**cfg, **(config or {})}, f)
    if tensors is not None:
        path = os.path.join(target, "adapter_model.safetensors")
        save_file(tensors(dict(load_file(path))), path)
    return str(target)


def renamed(tensors: dict, old: str, new: str) -> dict:
    return {k.replace(old, new): v for k, v in tensors.items()}


def nan_in_first(tensors: dict) -> dict:
    key = min(tensors)
    bad = tensors[key].copy()
    bad.flat[0] = np.nan
    return {**tensors, key: bad}


BAD = {              # case -> (source adapter, config changes, tensor changes, error type, words the message has)
    "rank 0": ("qv-r4", {"r": 0}, None, ModelLoadError, "rank must be an integer in [1, 1024], got 0"),
    "rank 100000": ("qv-r4", {"r": 100000}, None, ModelLoadError, "got 100000"),
    "rank disagrees with the factors": ("qv-r4", {"r": 3}, None, ModelLoadError, "at rank 3"),
    "a target module that does not exist": ("qv-r4", {"target_modules": ["q_proj", "qq_proj"]}, None, ModelLoadError,
                                            "target module 'qq_proj' does not exist"),
    "a regex matching nothing": ("qv-r4", {"target_modules": r".*\.attention\.wq"}, None, ModelLoadError, "matches no module"),
    "factors of a layer the base lacks": ("qv-r4", {}, lambda t: renamed(t, "layers.1.", "layers.7."), ModelLoadError,
                                          "blk.7.attn_q"),
    "factors of a module that is no linear layer": ("qv-r4", {}, lambda t: renamed(t, "self_attn.q_proj", "self_attn.rotary"),
                                                    ModelLoadError, "self_attn.rotary"),
    "a lone lora_A": ("qv-r4", {}, lambda t: {k: v for k, v in t.items() if "layers.0.self_attn.q_proj.lora_B" not in k},
                      ModelLoadError, "lacks lora_B"),
    "a NaN lora_alpha": ("qv-r4", {"lora_alpha": float("nan")}, None, ModelLoadError, "lora_alpha"),
    "NaN factors": ("qv-r4", {}, nan_in_first, ModelLoadError, "not finite"),
    "modules_to_save": ("qv-r4", {"modules_to_save": ["lm_head"]}, None, UnsupportedModelError, "modules_to_save"),
    "another adapter type": ("qv-r4", {"peft_type": "LOHA"}, None, UnsupportedModelError, "LOHA"),
    "DoRA magnitudes without use_dora": ("dora-r4", {"use_dora": False}, None, ModelLoadError, "use_dora"),
}


@pytest.fixture(scope="module")
def single(lora_setup):
    """The base with one adapter loaded (qv-r4) and room for more."""
    root = lora_setup[0]
    ours = Runtime(backend="cpu").load(str(root / "base"), progress=False, kv_dtype="f32", activations="f32")
    ours.load_lora(str(root / "qv-r4"))
    ours.load_lora(str(root / "dora-r4"), name="dora")
    return root, lora_setup[2], ours


@pytest.mark.parametrize("case", sorted(BAD))
def test_a_bad_adapter_is_a_clear_error_and_the_model_runs_on(single, tmp_path, case):
    root, tok, ours = single
    source, config, tensors, error, words = BAD[case]
    path = rewrite(root / source, tmp_path / "bad", config, tensors)
    ids = tok.encode(PROMPT).ids
    before, listed = ours.logits(ids, lora="qv-r4"), ours.list_loras()
    with pytest.raises(error) as e:
        ours.load_lora(path)
    assert words in str(e.value)
    assert ours.list_loras() == listed
    np.testing.assert_array_equal(ours.logits(ids, lora="qv-r4"), before)


def test_an_adapter_for_another_base_names_the_module(single, tmp_path):
    ours = single[-1]
    other, _ = build_model("llama", str(tmp_path / "other"), seed=3, hidden_size=32, intermediate_size=64, head_dim=8)
    make_adapter(other, ADAPTERS["qv-r4"], str(tmp_path / "for-other"), 0)
    with pytest.raises(ModelLoadError, match=r"module blk\.0\.attn_q: lora_A \[4, 32\].*another base"):
        ours.load_lora(str(tmp_path / "for-other"))


@pytest.mark.parametrize("call,error,words", [
    (lambda m, root: m.load_lora(str(root / "qv-r4"), alpha=float("nan"), name="nan"), ModelLoadError, "alpha"),
    (lambda m, root: m.logits([1, 2, 3], lora="dora", lora_scale=0.5), RequestError, "is DoRA"),
    (lambda m, root: m.load_lora(str(root / "base") + "/../qv-r4", name="up"), ModelLoadError, "'..'"),
    (lambda m, root: m.load_lora(str(root / "qv-r4"), name=".."), ModelLoadError, "adapter name"),
    (lambda m, root: m.load_lora(str(root / "qv-r4"), name="a/b"), ModelLoadError, "adapter name"),
    (lambda m, root: m.load_lora(str(root / "qv-r4")), RequestError, "loaded already"),
    (lambda m, root: m.load_lora(str(root / "no-such-adapter")), ModelLoadError, "not a PEFT adapter directory"),
    (lambda m, root: m.logits([1, 2, 3], lora="qv-r4", lora_scale=float("nan")), RequestError, "lora scale"),
    (lambda m, root: m.complete([1, 2, 3], lora="nobody"), RequestError, "no adapter named 'nobody'"),
    (lambda m, root: m.unload_lora("nobody"), RequestError, "no adapter named 'nobody'"),
], ids=["nan-alpha", "dora-at-another-scale", "dotdot-path", "dotdot-name", "slash-name", "name-taken", "missing-dir",
        "nan-scale", "unknown-request", "unknown-unload"])
def test_bad_calls_are_clear_errors(single, call, error, words):
    root, _, ours = single
    listed = ours.list_loras()
    with pytest.raises(error) as e:
        call(ours, root)
    assert words in str(e.value)
    assert ours.list_loras() == listed


def test_past_the_slots_adapters_wait_in_memory_and_take_the_least_recently_used_idle_slot(eight, lora_setup):
    """8 slots (max_loras), 32 adapters held: the ninth and later load into memory and, run, take the least
    recently used slot whose adapter no request runs under, giving their own logits (the evicted adapter's too
    when it runs again); past 32 every load is refused, 1,000 attempts too, the model unharmed; a request finding
    every slot busy with others' requests is refused; unloading frees room."""
    root = lora_setup[0]
    tok, ours = eight
    ids = tok.encode(PROMPT).ids
    before = {x["name"]: ours.logits(ids, lora=x["name"]) for x in ours.list_loras()}
    held = [f"held-{i}" for i in range(24)]
    for name in held:
        ours.load_lora(str(root / "regex-r2"), name=name)
    assert sum(x["in_slot"] for x in ours.list_loras()) == 8 and len(ours.list_loras()) == 32
    for i in range(1000):
        with pytest.raises(RequestError, match="all 32 adapters this model holds are loaded"):
            ours.load_lora(str(root / "qv-r4"), name=f"extra-{i}")
    alone = ours.logits(ids, lora="regex-r2")
    for name in held[::5]:                                   # each swapped into a slot, evicting an idle one
        close(ours.logits(ids, lora=name), alone, f"{name}, swapped in")
    for name, want in before.items():                        # the evicted ones swapped back, as they were
        np.testing.assert_array_equal(ours.logits(ids, lora=name), want)
    table = ours.engine.lora
    running = [table.use(name, 1.0) for name in held[:8]]   # eight sequences under eight adapters hold every slot
    assert sorted(v.slot for v in running) == list(range(8))
    with pytest.raises(RequestError, match="adapter slots .* run other adapters' requests"):
        ours.complete(ids, max_tokens=1, lora=held[8])
    for variant in running:
        table.release(variant)
    close(ours.logits(ids, lora=held[8]), alone, "once the slots are idle again")
    for name in held:
        ours.unload_lora(name)
    assert len(ours.list_loras()) == 8


def test_an_adapter_unloaded_mid_request_serves_that_request_to_its_end(eight):
    """Its slot stays the running request's (no adapter is written into it) until the request ends; new requests
    cannot pick it."""
    tok, ours = eight
    ids = tok.encode(PROMPT).ids
    want = [t.id for t in ours.generate(ids, max_tokens=10, temperature=0, ignore_eos=True, lora="patterns")]
    stream = ours.generate(ids, max_tokens=10, temperature=0, ignore_eos=True, lora="patterns")
    got = [next(stream).id]
    source = next(x["source"] for x in ours.list_loras() if x["name"] == "patterns")
    ours.unload_lora("patterns")
    with pytest.raises(RequestError, match="no adapter named 'patterns'"):
        ours.complete(ids, max_tokens=1, lora="patterns")
    ours.load_lora(source, name="taker")                     # into another slot: the retired one is the request's
    ours.complete(ids, max_tokens=1, lora="taker")
    got += [t.id for t in stream]
    assert got == want
    ours.unload_lora("taker")
    ours.load_lora(source, name="patterns")


@pytest.fixture(scope="module")
def gguf_bases(lora_setup):
    """The base converted to GGUF (f32 and q8_0), as llama.cpp's convert writes it: q/k rows permuted for
    interleaved rope, which an adapter's lora_B must follow."""
    from soma_runtime.convert import convert_hf_to_gguf
    root = lora_setup[0]
    return {t: convert_hf_to_gguf(str(root / "base"), str(root / f"base.{t}.gguf"), t) for t in ("f32", "q8_0")}


@pytest.mark.parametrize("name", ["all-r8-rslora", "dora-r4"])
def test_an_adapter_on_a_gguf_base_equals_peft(lora_setup, gguf_bases, name):
    root, _, tok, peft_models, _ = lora_setup
    ids = tok.encode(PROMPT).ids
    ours = Runtime(backend="cpu").load(gguf_bases["f32"], progress=False, kv_dtype="f32", activations="f32")
    ours.load_lora(str(root / name))
    close(ours.logits(ids, lora=name), reference_logits(peft_models[name], ids), f"{name} on an f32 GGUF")


def test_a_quantized_base_stays_quantized_and_takes_the_adapters_update(lora_setup, gguf_bases):
    """On a q8_0 base, the adapter changes the logits by what it changes PEFT's (within q8_0's rounding of
    the base), and the fused graph's linear layers still hold q8_0 blocks."""
    from soma_runtime.dtypes import QTensor
    root, base, tok, peft_models, _ = lora_setup
    ids = tok.encode(PROMPT).ids
    ours = Runtime(backend="cpu").load(gguf_bases["q8_0"], progress=False, kv_dtype="f32", activations="q8")
    plain = ours.logits(ids)
    ours.load_lora(str(root / "all-r8-rslora"))
    want = reference_logits(peft_models["all-r8-rslora"], ids) - reference_logits(base, ids)
    got = ours.logits(ids, lora="all-r8-rslora") - plain
    assert np.abs(want).max() > 0.5
    assert np.abs(got - want).max() <= 0.05 * np.abs(want).max(), np.abs(got - want).max()
    layers = [w for stage in ours.engine.stages for w in stage.layer_weights() if np.ndim(w) == 2]
    assert layers and all(isinstance(w, QTensor) and w.dtype.name == "q8_0" for w in layers)


def test_the_cli_runs_a_prompt_under_lora_path_scale(lora_setup, tmp_path):
    """`soma-runtime run --lora PATH:0.5` writes the greedy text of the library's run under that adapter at 0.5
    (itself PEFT's, above); a bad adapter is a clear error on stderr and exit status 1."""
    import subprocess
    import sys
    root = lora_setup[0]
    ours = Runtime(backend="cpu").load(str(root / "base"), progress=False)
    ours.load_lora(str(root / "mlp-r16"), alpha=0.5)
    want = ours.complete(PROMPT, max_tokens=8, temperature=0, lora="mlp-r16")
    run = [sys.executable, "-m", "soma_runtime.cli.main", "run", "--model", str(root / "base"), "--backend", "cpu",
           "--prompt", PROMPT, "--max-tokens", "8", "--temperature", "0"]
    r = subprocess.run([*run, "--lora", f"{root / 'mlp-r16'}:0.5"], capture_output=True, text=True, timeout=300, check=False)
    assert r.returncode == 0, r.stderr
    assert r.stdout == want + "\n"
    assert want != ours.complete(PROMPT, max_tokens=8, temperature=0)
    bad = rewrite(root / "qv-r4", tmp_path / "bad", {"r": 0})
    r = subprocess.run([*run, "--lora", bad], capture_output=True, text=True, timeout=300, check=False)
    assert r.returncode == 1 and "rank must be an integer in [1, 1024], got 0" in r.stderr


def test_a_self_speculative_draft_drafts_under_the_streams_adapter(lora_setup):
    """The draft of the model's own first layer shares its adapter slots: a stream under an adapter drafts
    the greedy tokens of that first layer under the adapter (not the base's), and the target's greedy
    tokens are those of plain decoding."""
    root, _, tok, _, _ = lora_setup
    ours = Runtime(backend="cpu").load(str(root / "base"), progress=False, kv_dtype="f32", activations="f32")
    ours.load_lora(str(root / "all-r8-rslora"))
    drafter = ours.drafter_of("layers:1")
    ids = tok.encode(PROMPT).ids
    adapted, base = (drafter.engine.logits(ids, lora=name)[-1] for name in ("all-r8-rslora", None))
    assert np.argmax(adapted) != np.argmax(base), "pick a prompt where the adapter changes the draft's choice"
    variant = ours.engine.variant("all-r8-rslora")
    try:
        (draft,) = drafter.propose([ids], [1], [0], [variant])
    finally:
        drafter.release(0)
        ours.engine.lora.release(variant)
    assert draft == [int(np.argmax(adapted))]
    plain = [t.id for t in ours.generate(ids, max_tokens=16, temperature=0, ignore_eos=True, lora="all-r8-rslora")]
    ours.speculate(drafter)
    assert [t.id for t in ours.generate(ids, max_tokens=16, temperature=0, ignore_eos=True, lora="all-r8-rslora")] == plain
    assert ours.metrics()["drafted_tokens"] > 0


def test_convert_merges_adapters_into_the_weights(lora_setup, tmp_path):
    """`convert --merge-lora`: a GGUF with a DoRA adapter merged gives PEFT's logits; one with an adapter
    merged at 0.5 gives the run-time adapter's at scale 0.5."""
    from soma_runtime.convert import convert_hf_to_gguf
    root, _, tok, peft_models, ours = lora_setup
    ids = tok.encode(PROMPT).ids
    exact = {"progress": False, "kv_dtype": "f32", "activations": "f32"}
    dora = convert_hf_to_gguf(str(root / "base"), str(tmp_path / "dora.gguf"), "f32", [(str(root / "dora-r4"), 1.0)])
    close(Runtime(backend="cpu").load(dora, **exact).logits(ids), reference_logits(peft_models["dora-r4"], ids), "DoRA merged")
    half = convert_hf_to_gguf(str(root / "base"), str(tmp_path / "half.gguf"), "f32", [(str(root / "mlp-r16"), 0.5)])
    want = ours.logits(ids, lora="mlp-r16", lora_scale=0.5)
    close(Runtime(backend="cpu").load(half, **exact).logits(ids), want, "merged at 0.5")


HF_TO_GGUF = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
              "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
              "mlp.down_proj": "ffn_down"}


def write_gguf_lora(peft_dir, out: str, heads: dict) -> str:
    """A PEFT adapter as llama.cpp's convert_lora_to_gguf.py writes it: NAME.weight.lora_a [rank, in] and
    .lora_b [out, rank] under GGUF names, q/k lora_b rows permuted for interleaved rope as the base's are,
    adapter.lora.alpha from the config."""
    import gguf
    config = json.loads((peft_dir / "adapter_config.json").read_text())
    w = gguf.GGUFWriter(out, "llama")
    w.add_string("general.type", "adapter")
    w.add_string("adapter.type", "lora")
    w.add_float32("adapter.lora.alpha", float(config["lora_alpha"]))
    for key, t in sorted(load_file(str(peft_dir / "adapter_model.safetensors")).items()):
        layer, module = key.removeprefix("base_model.model.model.layers.").split(".", 1)
        module, factor = module.rsplit(".lora_", 1)
        kind = HF_TO_GGUF[module]
        if factor == "B.weight" and kind in heads:
            n = heads[kind]
            t = t.reshape(n, 2, t.shape[0] // n // 2, *t.shape[1:]).swapaxes(1, 2).reshape(t.shape)
        w.add_tensor(f"blk.{layer}.{kind}.weight.lora_{factor[0].lower()}", np.ascontiguousarray(t, np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out


@pytest.mark.parametrize("name,scale", [("all-r8-rslora", 1.0), ("qv-r4", 0.5)])
def test_a_gguf_lora_on_a_q8_0_base_gives_llama_cpps_greedy_tokens(lora_setup, gguf_bases, tmp_path, name, scale):
    """llama.cpp's own LoRA file format on its q8_0 base, run by llama-cpp-python with lora_path/lora_scale:
    the same greedy tokens up to its near-ties (rsLoRA's alpha / sqrt(rank) folded into the file's alpha,
    as llama.cpp scales by alpha / rank)."""
    from llama_cpp import Llama

    from tests.llm.llama_reference import check_greedy, llama_greedy, near_tie
    root, base, tok, _, _ = lora_setup
    ids = tok.encode(PROMPT).ids
    peft_dir = root / name
    config = json.loads((peft_dir / "adapter_config.json").read_text())
    if config.get("use_rslora"):                 # GGUF LoRA knows alpha / rank only
        peft_dir = tmp_path / "plain"
        rewrite(root / name, peft_dir, {"use_rslora": False, "lora_alpha": config["lora_alpha"] * config["r"] ** 0.5})
    heads = {"attn_q": base.config.num_attention_heads, "attn_k": base.config.num_key_value_heads}
    lora = write_gguf_lora(peft_dir, str(tmp_path / f"{name}.gguf"), heads)
    llama = Llama(model_path=gguf_bases["q8_0"], lora_path=lora, lora_scale=scale, n_ctx=256, n_threads=2, verbose=False,
                  logits_all=True)
    want = llama_greedy(llama, ids, 24)
    ours = Runtime(backend="cpu").load(gguf_bases["q8_0"], progress=False)
    ours.load_lora(lora, alpha=scale)
    got = [t.id for t in ours.generate(ids, max_tokens=len(want.tokens), temperature=0, ignore_eos=True, lora=name)]
    plain = [t.id for t in ours.generate(ids, max_tokens=len(want.tokens), temperature=0, ignore_eos=True)]
    assert check_greedy(f"{name} at {scale}", got, want, near_tie([want])) >= 8
    assert got != plain, "the adapter changes nothing"


def test_a_gguf_that_is_no_lora_of_this_base_is_a_clear_error(single, gguf_bases, tmp_path):
    import gguf
    ours = single[-1]
    with pytest.raises(UnsupportedModelError, match="not a GGUF LoRA"):
        ours.load_lora(gguf_bases["f32"], name="base-file")
    w = gguf.GGUFWriter(str(tmp_path / "other.gguf"), "qwen2")
    w.add_string("general.type", "adapter")
    w.add_string("adapter.type", "lora")
    w.add_tensor("blk.0.attn_q.weight.lora_a", np.zeros((4, 64), np.float32))
    w.add_tensor("blk.0.attn_q.weight.lora_b", np.zeros((64, 4), np.float32))
    for part in (w.write_header_to_file, w.write_kv_data_to_file, w.write_tensors_to_file, w.close):
        part()
    with pytest.raises(ModelLoadError, match="an adapter for 'qwen2', the base is 'llama'"):
        ours.load_lora(str(tmp_path / "other.gguf"))


FAMILY_ADAPTERS = {      # family -> adapters on its own module names (phi3: fused qkv and gate_up)
    "qwen2": {"r": 4, "lora_alpha": 8, "use_dora": True, "target_modules": ["q_proj", "v_proj", "o_proj", "up_proj"]},
    "phi3": {"r": 8, "lora_alpha": 8, "target_modules": ["qkv_proj", "o_proj", "gate_up_proj", "down_proj"]},
    "gemma": {"r": 4, "lora_alpha": 16, "target_modules": "all-linear"},
    "mistral": {"r": 6, "lora_alpha": 6, "use_rslora": True, "target_modules": ["k_proj", "gate_proj", "down_proj"]},
}


@pytest.mark.parametrize("family", sorted(FAMILY_ADAPTERS))
def test_adapters_on_other_families_equal_peft(tmp_path, family):
    """qwen2's q/k/v biases (DoRA scales the product before the bias, as PEFT), phi3's fused projections,
    gemma's norms and tied head with PEFT's all-linear, mistral's sliding window."""
    hf, tok = build_model(family, str(tmp_path / "base"))
    peft = make_adapter(hf, FAMILY_ADAPTERS[family], str(tmp_path / "adapter"), 7)
    ids = tok.encode(PROMPT).ids
    want = reference_logits(peft, ids)
    assert np.abs(want - reference_logits(hf, ids)).max() > 0.05, "the adapter changes nothing"
    ours = Runtime(backend="cpu").load(str(tmp_path / "base"), progress=False, kv_dtype="f32", activations="f32")
    ours.load_lora(str(tmp_path / "adapter"))
    close(ours.logits(ids, lora="adapter"), want, family)


@pytest.mark.skipif("cuda" not in BACKENDS, reason="needs a GPU or Triton (interpreted)")
@pytest.mark.parametrize("gpu_layers", [None, 1])
def test_an_adapter_on_the_cuda_backend_whole_or_split_equals_peft(tmp_path, gpu_layers):
    """On cuda (its kernels interpreted where there is no GPU) lora_apply runs on the host, its inputs copied
    there; whole, or split with the first layer on cuda and the rest on the host, the logits are PEFT's."""
    hf, tok = build_model("qwen2", str(tmp_path / "base"))
    peft = make_adapter(hf, {"r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj", "down_proj"]},
                        str(tmp_path / "adapter"), 3)
    ids = tok.encode(PROMPT).ids
    ours = Runtime("cuda").load(str(tmp_path / "base"), progress=False, gpu_layers=gpu_layers, kv_dtype="f32")
    ours.load_lora(str(tmp_path / "adapter"))
    assert ours.engine.stages[0].backend.name == "cuda"
    close(ours.logits(ids, lora="adapter"), reference_logits(peft, ids), f"cuda, gpu_layers={gpu_layers}")
