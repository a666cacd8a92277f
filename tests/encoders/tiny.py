"""Tiny random-weight HF encoders (BERT, RoBERTa, XLM-RoBERTa, DeBERTa-v2, ModernBERT) with a WordPiece tokenizer, saved
the way transformers saves them, one directory per (family, head)."""
from __future__ import annotations

import torch
from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, processors

WORDS = ["the", "a", "quick", "brown", "fox", "jumps", "over", "lazy", "dog", "hello", "world", "this", "is", "tiny",
         "test", "of", "encoders", "and", "some", "more", "words", "to", "make", "longer", "sentences", "caf\u00e9",
         "na\u00efve", "city", "tokyo"]
FAMILIES = {
    # specials in the order each family's tokenizer numbers them; pad id feeds RoBERTa's positions
    "bert": {"specials": ["[PAD]", "[UNK]", "[CLS]", "[SEP]"], "pad": 0, "cls": 2, "sep": 3, "type_vocab_size": 2},
    "roberta": {"specials": ["<s>", "<pad>", "</s>", "<unk>"], "pad": 1, "cls": 0, "sep": 2, "type_vocab_size": 1},
    "xlm-roberta": {"specials": ["<s>", "<pad>", "</s>", "<unk>"], "pad": 1, "cls": 0, "sep": 2, "type_vocab_size": 1},
    "modernbert": {"specials": ["[PAD]", "[UNK]", "[CLS]", "[SEP]"], "pad": 0, "cls": 2, "sep": 3},
    "deberta-v2": {"specials": ["[PAD]", "[CLS]", "[SEP]", "[UNK]"], "pad": 0, "cls": 1, "sep": 2, "type_vocab_size": 0},
}
LABELS = {0: "entailment", 1: "neutral", 2: "contradiction"}


def tokenizer(family: str) -> Tokenizer:
    spec = FAMILIES[family]
    vocab = {tok: i for i, tok in enumerate(spec["specials"] + WORDS + [f"##{c}" for c in "abcdefghijklmnopqrstuvwxyz"])}
    unk = "[UNK]" if "[UNK]" in spec["specials"] else "<unk>"
    tok = Tokenizer(models.WordPiece(vocab, unk_token=unk))
    tok.normalizer = normalizers.BertNormalizer(lowercase=True)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    cls, sep = (spec["specials"][spec["cls"]], spec["cls"]), (spec["specials"][spec["sep"]], spec["sep"])
    tok.post_processor = processors.RobertaProcessing(sep, cls) if "roberta" in family else processors.BertProcessing(sep, cls)
    return tok


def build(family: str, head: str | None, directory, pooling: str = "cls") -> torch.nn.Module:
    """Save a tiny `family` model with `head` (None, "sequence", "token") and its tokenizer; return it.
    `pooling` is ModernBERT's classifier pooling (cls or mean)."""
    import transformers
    spec = FAMILIES[family]
    tok = tokenizer(family)
    names = {"bert": "Bert", "roberta": "Roberta", "xlm-roberta": "XLMRoberta", "modernbert": "ModernBert",
             "deberta-v2": "DebertaV2"}[family]
    shape = {"vocab_size": tok.get_vocab_size(), "hidden_size": 32, "num_attention_heads": 4, "intermediate_size": 64,
             "pad_token_id": spec["pad"], "id2label": LABELS, "label2id": {v: k for k, v in LABELS.items()}}
    if family == "modernbert":              # 4 layers: global, local, local, global; a window shorter than the texts
        config = transformers.ModernBertConfig(**shape, num_hidden_layers=4, max_position_embeddings=64, local_attention=6,
                                               global_attn_every_n_layers=3, classifier_pooling=pooling,
                                               cls_token_id=spec["cls"], sep_token_id=spec["sep"], bos_token_id=spec["cls"],
                                               eos_token_id=spec["sep"], attn_implementation="eager")
    elif family == "deberta-v2":            # v3's layout; 8 buckets put the texts' longer distances in log buckets
        config = transformers.DebertaV2Config(**shape, num_hidden_layers=2, max_position_embeddings=40, type_vocab_size=0,
                                              relative_attention=True, position_buckets=8, max_relative_positions=40,
                                              pos_att_type=["p2c", "c2p"], share_att_key=True, norm_rel_ebd="layer_norm",
                                              position_biased_input=False, hidden_act="gelu", pooler_hidden_act="gelu")
    else:
        config = getattr(transformers, f"{names}Config")(**shape, num_hidden_layers=2, max_position_embeddings=40,
                                                         type_vocab_size=spec["type_vocab_size"], hidden_act="gelu")
    suffix = {None: "Model", "sequence": "ForSequenceClassification", "token": "ForTokenClassification"}[head]
    torch.manual_seed(0)
    model = getattr(transformers, f"{names}{suffix}")(config).eval()
    with torch.no_grad():                   # move every weight off its init (layernorms included)
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    model.save_pretrained(directory)
    tok.save(str(directory / "tokenizer.json"))
    return model
