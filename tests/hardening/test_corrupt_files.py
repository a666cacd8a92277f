"""Corrupt, lying and hostile model files end in a ModelLoadError (or UnsupportedModelError) that names
the file and the field, before anything is allocated from what they claim: never a traceback, never
a load that exhausts memory, never a model that silently computes garbage."""
from __future__ import annotations

import json
import os
import shutil
import struct
import subprocess
import sys

import numpy as np
import pytest

from soma_runtime.errors import ModelLoadError, RequestError
from soma_runtime.loaders import load
from soma_runtime.tasks import Runtime
from tests.fixtures.decoders import build_model
from tests.hardening.files import ARRAY, STRING, U32, U64, Gguf, nested_arrays, safetensors_bytes


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    directory = str(tmp_path_factory.mktemp("tiny"))
    build_model("llama", directory)
    return directory


@pytest.fixture(scope="module")
def tiny_gguf(tiny_dir, tmp_path_factory):
    from soma_runtime.convert import convert_hf_to_gguf
    return convert_hf_to_gguf(tiny_dir, str(tmp_path_factory.mktemp("gguf") / "tiny.gguf"), "f16")


def gguf_with(tiny_gguf, tmp_path, edit, **save) -> str:
    g = Gguf.read(tiny_gguf)
    edit(g)
    return g.save(tmp_path / "bad.gguf", **save)


def first(g: Gguf) -> str:
    return next(iter(g.tensors))


def set_dims(dims):
    def edit(g):
        kind, _, raw = g.tensors[first(g)]
        g.tensors[first(g)] = (kind, dims, raw)
    return edit


def set_kv(key, kind, value):
    def edit(g):
        g.kv[key] = (kind, value)
    return edit


def nan_in(name):
    def edit(g):
        kind, dims, raw = g.tensors[name]
        values = np.frombuffer(raw, np.float16 if kind == 1 else np.float32).copy()
        values[len(values) // 2] = np.nan
        g.tensors[name] = (kind, dims, values.tobytes())
    return edit


GGUF_CASES = {
    "dim of zero": (set_dims([0, 64]), "dims"),
    "dim of 2^63": (set_dims([2**63, 64]), "dims"),
    "five dims": (set_dims([4, 4, 4, 4, 4]), "dims"),
    "alignment 0": (lambda g: setattr(g, "alignment", 0), "general.alignment"),
    "alignment 48": (lambda g: setattr(g, "alignment", 48), "general.alignment"),
    "head_count 0": (set_kv("llama.attention.head_count", U32, 0), "llama.attention.head_count"),
    "block_count 0": (set_kv("llama.block_count", U32, 0), "llama.block_count"),
    "block_count 2^31": (set_kv("llama.block_count", U32, 2**31), "llama.block_count"),
    "block_count 2^40": (set_kv("llama.block_count", U64, 2**40), "llama.block_count"),
    "embedding_length a string": (set_kv("llama.embedding_length", STRING, "sixty-four"), "llama.embedding_length"),
    "context_length 0": (set_kv("llama.context_length", U32, 0), "llama.context_length"),
    "eos_token_id out of range": (set_kv("tokenizer.ggml.eos_token_id", U32, 10**6), "eos_token_id"),
    "tokens not strings": (set_kv("tokenizer.ggml.tokens", ARRAY, (U32, list(range(300)))), "tokenizer.ggml.tokens"),
    "scores of the wrong length": (set_kv("tokenizer.ggml.scores", ARRAY, (6, [0.0] * 3)), "tokenizer.ggml.scores"),
    "200,000 nested arrays": (lambda g: g.raw_kv.append(struct.pack("<Q", 4) + b"deep" + struct.pack("<I", ARRAY)
                                                         + nested_arrays(200_000)), "nested"),
    "an array longer than the file": (lambda g: g.raw_kv.append(struct.pack("<Q", 4) + b"long"
                                                                + struct.pack("<IIQ", ARRAY, STRING, 2**40)), "array"),
    "a string longer than the file": (lambda g: g.raw_kv.append(struct.pack("<Q", 2**60) + b"x"), "string"),
    "NaN weights": (nan_in("blk.0.attn_q.weight"), "blk.0.attn_q.weight.*NaN"),
}


@pytest.mark.parametrize("case", list(GGUF_CASES))
def test_a_corrupt_gguf_names_the_file_and_field(tiny_gguf, tmp_path, case):
    edit, field = GGUF_CASES[case]
    path = gguf_with(tiny_gguf, tmp_path, edit)
    with pytest.raises(ModelLoadError, match=f"bad.gguf.*{field}"):
        Runtime().load(path, progress=False)


@pytest.mark.parametrize("counts, needle", [({"n_kv": 2**40}, "metadata entries"), ({"n_tensors": 2**33}, "tensors"),
                                            ({"version": 7}, "version")])
def test_gguf_counts_that_lie_are_refused_before_reading_them(tiny_gguf, tmp_path, counts, needle):
    path = gguf_with(tiny_gguf, tmp_path, lambda g: None, **counts)
    with pytest.raises(ModelLoadError, match=f"bad.gguf.*{needle}"):
        load(path)


def test_gguf_tensors_that_overlap_are_refused(tiny_gguf, tmp_path):
    g = Gguf.read(tiny_gguf)
    a, b = list(g.tensors)[:2]
    path = g.save(tmp_path / "bad.gguf", offsets={b: 0, a: 0})
    with pytest.raises(ModelLoadError, match="bad.gguf.*overlap"):
        load(path)


def test_a_broken_chat_template_fails_chats_but_not_raw_prompts(tiny_gguf, tmp_path):
    path = gguf_with(tiny_gguf, tmp_path, set_kv("tokenizer.chat_template", STRING, "{% for m in messages %}{{ m.content"))
    model = Runtime().load(path, progress=False)
    assert len(list(model.generate("Hello", max_tokens=3, temperature=0))) == 3
    with pytest.raises(ModelLoadError, match="bad.gguf.*chat template does not compile"):
        model.chat([{"role": "user", "content": "Hi"}])


def hf_with(tiny_dir, tmp_path, config=None, files=None) -> str:
    """A copy of the tiny HF directory; `config(dict) -> dict | bytes` rewrites config.json, `files`
    maps a file name to new bytes."""
    bad = tmp_path / "bad"
    shutil.copytree(tiny_dir, bad)
    if config is not None:
        new = config(json.loads((bad / "config.json").read_text()))
        (bad / "config.json").write_bytes(new if isinstance(new, bytes) else json.dumps(new).encode())
    for name, raw in (files or {}).items():
        (bad / name).write_bytes(raw)
    return str(bad)


def drop(key):
    return lambda c: {k: v for k, v in c.items() if k != key}


HF_CASES = {
    "binary config.json": (lambda c: bytes(range(256)) * 4, "config.json.*invalid JSON"),
    "config.json a list": (lambda c: [c], "config.json.*JSON object"),
    "num_attention_heads 0": (lambda c: {**c, "num_attention_heads": 0}, "config.json.*num_attention_heads"),
    "hidden_size a string": (lambda c: {**c, "hidden_size": "sixteen"}, "config.json.*hidden_size"),
    "no intermediate_size": (drop("intermediate_size"), "config.json.*intermediate_size"),
    "num_hidden_layers 1e9": (lambda c: {**c, "num_hidden_layers": 10**9}, "config.json.*num_hidden_layers"),
    "eos_token_id out of range": (lambda c: {**c, "eos_token_id": 99999}, "config.json.*eos_token_id"),
    "max_position_embeddings 0": (lambda c: {**c, "max_position_embeddings": 0}, "config.json.*max_position_embeddings"),
    "heads that do not share kv heads": (lambda c: {**c, "num_key_value_heads": 3}, "config.json.*kv heads"),
    "rope_parameters a string": (lambda c: {**c, "rope_parameters": "yes"}, "config.json.*rope_parameters"),
    "rope_parameters without a factor": (lambda c: {**c, "rope_parameters": {"rope_type": "llama3", "rope_theta": 1e4}},
                                         "config.json.*rope.*factor"),
    "nested 100,000 deep": (lambda c: b"[" * 100_000 + b"]" * 100_000, "config.json.*invalid JSON"),
}


@pytest.mark.parametrize("case", list(HF_CASES))
def test_a_corrupt_config_names_the_file_and_field(tiny_dir, tmp_path, case):
    edit, field = HF_CASES[case]
    with pytest.raises(ModelLoadError, match=field):
        Runtime().load(hf_with(tiny_dir, tmp_path, config=edit), progress=False)


def weights_of(tiny_dir) -> tuple[dict, bytes]:
    with open(os.path.join(tiny_dir, "model.safetensors"), "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        return json.loads(f.read(n)), f.read()


def edited_header(edit):
    def make(tiny_dir):
        header, data = weights_of(tiny_dir)
        return safetensors_bytes(edit(header), data)
    return make


def span(entry: dict) -> int:
    """The bytes a safetensors entry's data takes."""
    return entry["data_offsets"][1] - entry["data_offsets"][0]


def one_entry(change):
    def edit(header):
        name = next(k for k in header if k != "__metadata__")
        header[name] = change(dict(header[name]))
        return header
    return edit


SAFETENSORS_CASES = {
    "a header that is a list": (edited_header(lambda h: [h]), "header is a JSON list"),
    "an entry without data_offsets": (edited_header(one_entry(lambda e: {k: v for k, v in e.items() if k != "data_offsets"})),
                                      "data_offsets"),
    "a negative shape": (edited_header(one_entry(lambda e: {**e, "shape": [-1, *e["shape"][1:]]})), "shape"),
    "a shape that lies": (edited_header(one_entry(lambda e: {**e, "shape": [e["shape"][0] * 1000, *e["shape"][1:]]})),
                          "does not fit"),
    "an unknown dtype": (edited_header(one_entry(lambda e: {**e, "dtype": "F8_E9M9"})), "dtype"),
    "overlapping tensors": (edited_header(lambda h: {**h, **{k: {**v, "data_offsets": [0, span(v)]}
                                                              for k, v in h.items() if k != "__metadata__"}}),
                            "overlap|does not fit"),
    "a header longer than the file": (lambda d: safetensors_bytes({}, header_len=2**40), "header of"),
    "eight bytes": (lambda d: struct.pack("<Q", 0), "header|JSON"),
    "three bytes": (lambda d: b"abc", "safetensors"),
}


@pytest.mark.parametrize("case", list(SAFETENSORS_CASES))
def test_a_corrupt_safetensors_names_the_file_and_tensor(tiny_dir, tmp_path, case):
    make, needle = SAFETENSORS_CASES[case]
    with pytest.raises(ModelLoadError, match=f"model.safetensors.*({needle})"):
        load(hf_with(tiny_dir, tmp_path, files={"model.safetensors": make(tiny_dir)}))


def test_a_huge_header_in_a_sparse_file_is_refused_without_reading_it(tiny_dir, tmp_path):
    import resource
    bad = hf_with(tiny_dir, tmp_path)
    path = os.path.join(bad, "model.safetensors")
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", 1_500_000_000))
        f.truncate(1_600_000_000)                     # sparse: no disk, 1.5 GB of "header"
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    with pytest.raises(ModelLoadError, match="header of 1500000000 bytes"):
        load(bad)
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before < 100_000      # KiB: nothing near 1.5 GB read


def test_nan_weights_in_safetensors_are_refused(tiny_dir, tmp_path):
    header, data = weights_of(tiny_dir)
    name = "model.layers.1.mlp.down_proj.weight"
    start, end = header[name]["data_offsets"]
    values = np.frombuffer(data[start:end], np.float32).copy()
    values[7] = np.inf
    data = data[:start] + values.tobytes() + data[end:]
    with pytest.raises(ModelLoadError, match="blk.1.ffn_down.weight.*NaN or infinite"):
        load(hf_with(tiny_dir, tmp_path, files={"model.safetensors": safetensors_bytes(header, data)}))


@pytest.mark.parametrize("content", [b"\x00\xff garbage", b'{"model": {"type": "BPE", "vocab": 5}}', b"[]"])
def test_a_garbage_tokenizer_json_names_the_file(tiny_dir, tmp_path, content):
    with pytest.raises(ModelLoadError, match="tokenizer.json"):
        load(hf_with(tiny_dir, tmp_path, files={"tokenizer.json": content}))


def test_an_index_that_points_outside_the_directory_is_refused(tiny_dir, tmp_path):
    index = json.dumps({"weight_map": {"model.embed_tokens.weight": "../../etc/passwd"}}).encode()
    with pytest.raises(ModelLoadError, match="model.safetensors.index.json.*file names in the directory"):
        load(hf_with(tiny_dir, tmp_path, files={"model.safetensors.index.json": index}))


def test_invalid_sampling_defaults_are_a_load_error(tiny_dir, tmp_path):
    bad = hf_with(tiny_dir, tmp_path, files={"generation_config.json": b'{"temperature": "hot", "do_sample": true}'})
    with pytest.raises(ModelLoadError, match="bad.*sampling defaults.*temperature"):
        Runtime().load(bad, progress=False)


@pytest.mark.parametrize("option", ["n_ctx", "kv_tokens"])
@pytest.mark.parametrize("value", [0, -5, 2.5, True])
def test_a_context_or_pool_length_that_is_not_positive_is_refused(tiny_dir, option, value):
    with pytest.raises(RequestError, match=option):
        Runtime().load(tiny_dir, progress=False, **{option: value})


@pytest.mark.parametrize("ctx", ["0", "-5", "many"])
def test_the_cli_refuses_a_context_that_is_not_positive(ctx):
    r = subprocess.run([sys.executable, "-m", "soma_runtime.cli.main", "run", "--ctx", ctx, "--prompt", "hi"],
                       capture_output=True, text=True, timeout=120, check=False)
    assert r.returncode == 2 and "--ctx" in r.stderr and "Traceback" not in r.stderr
