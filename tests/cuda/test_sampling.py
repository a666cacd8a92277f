"""The CUDA sampler over a wide vocabulary: parts give their best candidates, merged in rounds until one
program takes the last; the token drawn is the torch pipeline's."""
from __future__ import annotations

import pytest
import torch

from soma_runtime.backends import run_op
from tests.backends import BACKENDS
from tests.backends.test_ops import sampling_rows, torch_sample

pytestmark = pytest.mark.skipif("cuda" not in BACKENDS, reason="needs a GPU or Triton (interpreted)")


@pytest.mark.parametrize("rows", [slice(2, 3), slice(0, 8)], ids=["one row", "rows"])
def test_a_wide_vocabulary_merges_in_rounds_to_the_reference_choice(rows):
    """At least one merge round under the tiles in force (two for one row): an interpreted run's tiles
    merge past 128 candidates, the GPU's past 512 for one row and 4096 for several."""
    from soma_runtime.backends.cuda.device import INTERPRET
    logits, params = sampling_rows(2000 if INTERPRET else 200_000, rows=4, seed=2)("f32")
    logits, params = logits[rows], params[rows]
    got = run_op("sample", logits, params, backend="cuda", width=64)
    want = torch_sample(torch.from_numpy(logits), torch.from_numpy(params), 64)
    assert list(got) == want.tolist()
