"""The whisper template against transformers on a tiny random WhisperForConditionalGeneration built here:
the encoder's output for random log-mel features, and the decoder's logits over a token prefix attending
to that output (both within 1e-4), on the cpu and reference backends."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from transformers import WhisperConfig as HFWhisperConfig
from transformers import WhisperForConditionalGeneration

from soma_runtime.architectures.weights import Weights
from soma_runtime.architectures.whisper import WhisperConfig, build_decoder, build_encoder
from soma_runtime.errors import ModelLoadError
from soma_runtime.tasks import Runtime
from tests.fixtures.decoders import randomize

HF = {"vocab_size": 120, "d_model": 64, "encoder_layers": 2, "encoder_attention_heads": 4, "encoder_ffn_dim": 128,
      "decoder_layers": 2, "decoder_attention_heads": 4, "decoder_ffn_dim": 128, "num_mel_bins": 80,
      "max_source_positions": 1500, "max_target_positions": 64, "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2,
      "decoder_start_token_id": 1}


@pytest.fixture(scope="module")
def whisper():
    torch.manual_seed(0)
    model = WhisperForConditionalGeneration(HFWhisperConfig(**HF)).eval()
    randomize(model, seed=0, scale=0.2)
    weights = Weights({k: v.detach().numpy() for k, v in model.state_dict().items()}, "tiny whisper")
    return model, WhisperConfig.from_hf(HF), weights


@pytest.mark.parametrize("backend", ["cpu", "reference"])
def test_encoder_and_decoder_match_transformers(whisper, backend):
    model, cfg, weights = whisper
    rng = np.random.default_rng(0)
    features = rng.normal(0, 1, (1, 80, 3000)).astype(np.float32)
    ids = np.array([[1, 7, 33, 90, 4]], np.int64)
    with torch.no_grad():
        theirs = model(input_features=torch.from_numpy(features), decoder_input_ids=torch.from_numpy(ids))
    runtime = Runtime(backend)
    encoded = runtime.load(build_encoder(cfg, weights), progress=False).run({"features": features})
    encoded = next(iter(encoded.values()))
    np.testing.assert_allclose(encoded, theirs.encoder_last_hidden_state.numpy(), atol=1e-4, rtol=0)
    decoder = runtime.load(build_decoder(cfg, weights), progress=False)
    logits = next(iter(decoder.run({"ids": ids, "positions": np.arange(5)[None], "encoded": encoded}).values()))
    np.testing.assert_allclose(logits, theirs.logits.numpy(), atol=1e-4, rtol=0)


def test_a_bad_config_is_a_load_error():
    with pytest.raises(ModelLoadError, match="not a multiple"):
        WhisperConfig.from_hf({**HF, "encoder_attention_heads": 5})
    with pytest.raises(ModelLoadError, match="positive integer"):
        WhisperConfig.from_hf({**HF, "d_model": "64"})
