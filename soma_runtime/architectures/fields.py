"""Typed checks of a model's raw config fields (config.json, config.toml, GGUF metadata) before any of
them sizes anything: a field that is missing, of the wrong type or out of range is a ModelLoadError
naming the file and the field, never a KeyError deep in a template or an allocation that cannot end.

The bounds are far above any real model's and far below what would exhaust memory; tensor shapes are
then checked against the config, and tensor sizes against the file.
"""
from __future__ import annotations

import math
from collections.abc import Mapping
from contextlib import contextmanager
from dataclasses import dataclass

from soma_runtime.errors import ModelLoadError

MAX_SIZE = 2**24           # widths, vocabularies, context lengths
MAX_LAYERS = 1024
MAX_HEADS = 4096


@dataclass(frozen=True)
class Field:
    kind: type                     # int or float
    low: float
    high: float
    required: bool = False

    def check(self, key: str, value, source: str) -> None:
        if self.kind is int:
            ok = isinstance(value, int) and not isinstance(value, bool)
        else:
            ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
        if not ok or not self.low <= value <= self.high:
            what = "an integer" if self.kind is int else "a number"
            raise ModelLoadError(f"{source}: {key} must be {what} in [{self.low:g}, {self.high:g}], got {value!r}")


SIZE = Field(int, 1, MAX_SIZE, required=True)
LAYERS = Field(int, 1, MAX_LAYERS, required=True)
HEADS = Field(int, 1, MAX_HEADS, required=True)
OPTIONAL_SIZE = Field(int, 1, MAX_SIZE)
OPTIONAL_HEADS = Field(int, 1, MAX_HEADS)
CONTEXT = Field(int, 2, MAX_SIZE)                 # room for a prompt token and one more
COUNT = Field(int, 0, MAX_SIZE)                   # may be 0: a window, a vocabulary of token types
TOKEN = Field(int, 0, MAX_SIZE)
EPSILON = Field(float, 0, 1)
POSITIVE = Field(float, 1e-30, 1e30)
REQUIRED_POSITIVE = Field(float, 1e-30, 1e30, required=True)
FRACTION = Field(float, 1e-30, 1)
SCALE = Field(float, 0, 1e30)


# the fields each format's config is read from, by the names it gives them
HF_FIELDS = {"vocab_size": SIZE, "hidden_size": SIZE, "num_hidden_layers": LAYERS, "num_attention_heads": HEADS,
             "intermediate_size": SIZE, "num_key_value_heads": OPTIONAL_HEADS, "head_dim": OPTIONAL_SIZE,
             "max_position_embeddings": CONTEXT, "rms_norm_eps": EPSILON, "rope_theta": POSITIVE,
             "partial_rotary_factor": FRACTION, "query_pre_attn_scalar": POSITIVE, "attn_logit_softcapping": SCALE,
             "final_logit_softcapping": SCALE, "sliding_window": COUNT, "rope_local_base_freq": POSITIVE}
ROPE_FIELDS = {"default": {"rope_theta": REQUIRED_POSITIVE},
               "linear": {"rope_theta": REQUIRED_POSITIVE, "factor": REQUIRED_POSITIVE},
               "dynamic": {"rope_theta": REQUIRED_POSITIVE, "factor": REQUIRED_POSITIVE, "original_max_position_embeddings": SIZE,
                           "context": OPTIONAL_SIZE},
               "llama3": {"rope_theta": REQUIRED_POSITIVE, "factor": REQUIRED_POSITIVE, "low_freq_factor": REQUIRED_POSITIVE,
                          "high_freq_factor": REQUIRED_POSITIVE, "original_max_position_embeddings": SIZE},
               "yarn": {"rope_theta": REQUIRED_POSITIVE, "factor": REQUIRED_POSITIVE, "original_max_position_embeddings": SIZE,
                        "beta_fast": POSITIVE, "beta_slow": POSITIVE, "mscale": POSITIVE, "mscale_all_dim": POSITIVE,
                        "attention_factor": POSITIVE}}
GGUF_FIELDS = {"block_count": LAYERS, "embedding_length": SIZE, "attention.head_count": HEADS,
               "attention.head_count_kv": OPTIONAL_HEADS, "attention.key_length": OPTIONAL_SIZE, "feed_forward_length": SIZE,
               "context_length": CONTEXT, "vocab_size": OPTIONAL_SIZE, "rope.dimension_count": OPTIONAL_SIZE,
               "rope.freq_base": POSITIVE, "attention.layer_norm_rms_epsilon": EPSILON, "attention.sliding_window": COUNT,
               "attn_logit_softcapping": SCALE, "final_logit_softcapping": SCALE, "rope.scaling.factor": POSITIVE,
               "rope.scaling.original_context_length": OPTIONAL_SIZE, "rope.scaling.yarn_beta_fast": POSITIVE,
               "rope.scaling.yarn_beta_slow": POSITIVE}
ENCODER_FIELDS = {"vocab_size": SIZE, "hidden_size": SIZE, "num_hidden_layers": LAYERS, "num_attention_heads": HEADS,
                  "intermediate_size": SIZE, "max_position_embeddings": CONTEXT, "type_vocab_size": COUNT,
                  "layer_norm_eps": EPSILON, "norm_eps": EPSILON, "pad_token_id": TOKEN, "local_attention": COUNT,
                  "global_attn_every_n_layers": OPTIONAL_SIZE, "global_rope_theta": POSITIVE, "local_rope_theta": POSITIVE,
                  "position_buckets": Field(int, -1, MAX_SIZE), "max_relative_positions": Field(int, -1, MAX_SIZE)}


def check_fields(raw: Mapping, fields: dict[str, Field], source: str) -> None:
    """Every field of `fields` that `raw` has (and every required one) is of its kind and in its range."""
    if not isinstance(raw, Mapping):
        raise ModelLoadError(f"{source}: expected a mapping of fields, got {type(raw).__name__}")
    for key, field in fields.items():
        value = raw.get(key)
        if value is None:
            if field.required:
                raise ModelLoadError(f"{source}: the required field {key} is missing")
            continue
        field.check(key, value, source)


def check_token_ids(ids, vocab_size: int, key: str, source: str) -> None:
    """Special token ids (an int or a list of them) inside the vocabulary."""
    for i in ids if isinstance(ids, (list, tuple)) else [ids]:
        if i is not None and (not isinstance(i, int) or isinstance(i, bool) or not 0 <= i < vocab_size):
            raise ModelLoadError(f"{source}: {key} {i!r} is outside the vocabulary of {vocab_size} tokens")


def table(raw: Mapping, key: str, source: str) -> dict:
    """A nested table of fields (rope_scaling, text_config, ...), {} where absent."""
    value = raw.get(key)
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        raise ModelLoadError(f"{source}: {key} must be a table of fields, got {type(value).__name__}")
    return dict(value)


@contextmanager
def reading(source: str):
    """The backstop around turning raw fields into a config: a value of a shape nothing checked for
    ends as a ModelLoadError naming the file, not as the TypeError it caused."""
    try:
        yield
    except (KeyError, TypeError, ValueError, AttributeError, ZeroDivisionError, OverflowError, IndexError) as e:
        raise ModelLoadError(f"{source}: malformed config ({type(e).__name__}: {e})") from None
