"""GGUF tokenizers of the SentencePiece (`llama`) kind against transformers and llama.cpp, and
UTF-8-safe incremental detokenization."""
from __future__ import annotations

import gguf
import numpy as np
import pytest

from soma_runtime.loaders import default_model_path
from soma_runtime.loaders.gguf import read_gguf
from soma_runtime.text.tokenizer import IncrementalDetokenizer, Tokenizer

CORPUS = ["The quick brown fox jumps over the lazy dog.", "Sentencepiece splits words into pieces.",
          "Numbers like 2024 and 3.14 appear.", "Caf\u00e9 na\u00efve r\u00e9sum\u00e9 \u00fcber."] * 50
TEXTS = ["The quick brown fox.", "pieces and words", "  leading spaces", "unseen: \u6771\u4eac \U0001F600 zebra!",
         "Numbers 12345", "line one\nline two"]


@pytest.fixture(scope="module")
def spm_gguf(tmp_path_factory):
    """A GGUF carrying a real SentencePiece BPE vocabulary (trained here) and a one-layer llama."""
    import sentencepiece as spm
    root = tmp_path_factory.mktemp("spm")
    (root / "corpus.txt").write_text("\n".join(CORPUS))
    spm.SentencePieceTrainer.train(input=str(root / "corpus.txt"), model_prefix=str(root / "sp"), vocab_size=300,
                                   model_type="bpe", byte_fallback=True, character_coverage=1.0,
                                   bos_id=1, eos_id=2, unk_id=0, pad_id=-1, minloglevel=2)
    sp = spm.SentencePieceProcessor(model_file=str(root / "sp.model"))
    tokens = [sp.id_to_piece(i) for i in range(sp.get_piece_size())]
    scores = [sp.get_score(i) for i in range(len(tokens))]
    types = [2 if sp.is_unknown(i) else 3 if sp.is_control(i) else 6 if sp.is_byte(i) else 1 for i in range(len(tokens))]
    path = str(root / "spm.gguf")
    w = gguf.GGUFWriter(path, "llama")
    for key, value in [("context_length", 64), ("embedding_length", 32), ("block_count", 1), ("feed_forward_length", 64),
                       ("attention.head_count", 2), ("attention.head_count_kv", 2)]:
        w.add_uint32(f"llama.{key}", value)
    w.add_float32("llama.attention.layer_norm_rms_epsilon", 1e-5)
    w.add_tokenizer_model("llama")
    w.add_token_list(tokens)
    w.add_token_scores(scores)
    w.add_token_types(types)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_unk_token_id(0)
    rng = np.random.default_rng(0)
    for name, shape in [("token_embd.weight", (len(tokens), 32)), ("output_norm.weight", (32,)),
                        ("blk.0.attn_norm.weight", (32,)), ("blk.0.ffn_norm.weight", (32,)),
                        ("blk.0.attn_q.weight", (32, 32)), ("blk.0.attn_k.weight", (32, 32)), ("blk.0.attn_v.weight", (32, 32)),
                        ("blk.0.attn_output.weight", (32, 32)), ("blk.0.ffn_gate.weight", (64, 32)),
                        ("blk.0.ffn_up.weight", (64, 32)), ("blk.0.ffn_down.weight", (32, 64))]:
        w.add_tensor(name, rng.standard_normal(shape).astype(np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_sentencepiece_gguf_tokenizer_matches_transformers_and_llama_cpp(spm_gguf):
    import os

    from llama_cpp import Llama
    from transformers import AutoTokenizer
    ours = Tokenizer.from_gguf(read_gguf(spm_gguf).metadata)
    hf = AutoTokenizer.from_pretrained(os.path.dirname(spm_gguf), gguf_file=os.path.basename(spm_gguf))
    llama = Llama(model_path=spm_gguf, vocab_only=True, verbose=False)
    for text in TEXTS:
        ids = ours.encode(text)                                              # BOS added, as llama.cpp does
        reference = llama.tokenize(text.encode(), add_bos=True, special=False)
        assert ids == reference, text
        # transformers and llama.cpp disagree on leading spaces; we follow llama.cpp, the GGUF reference
        if hf.encode(text) == reference:
            assert ours.decode(ids) == hf.decode(ids, skip_special_tokens=True), text


def test_incremental_detokenizer_never_splits_a_character():
    tok = Tokenizer.from_gguf(read_gguf(default_model_path()).metadata)
    text = "Gr\u00fc\u00dfe aus \u6771\u4eac \U0001F600\U0001F680 \u0645\u0631\u062d\u0628\u0627 \u2014 done."
    ids = tok.encode(text)
    detok = IncrementalDetokenizer(tok)
    pieces = [detok.push(i) for i in ids]
    assert "".join(pieces) == text
    assert not any("\ufffd" in p for p in pieces)
