"""The CUDA decode attention merges its shares in the kernel: the last share of each (row, kv head)
to finish merges them and resets that pair's count for the next launch."""
from __future__ import annotations

import pytest
import torch

from soma_runtime.ir.jets import max_error, run_op
from tests.backends import BACKENDS
from tests.test_ops import long_decode_inputs, paged_attention_ref

pytestmark = pytest.mark.skipif("cuda" not in BACKENDS, reason="needs a GPU or Triton (interpreted)")


def test_consecutive_launches_each_merge_their_shares():
    """A count left over from one launch would make the next merge early, late or never."""
    first = long_decode_inputs()("f32")
    second = [first[0][:, ::-1].copy(), *first[1:]]                 # other queries, same cache
    for inputs in (first, second, first):
        want = paged_attention_ref()(*[torch.from_numpy(x) for x in inputs]).numpy()
        err, scale = max_error(run_op("paged_attention", *inputs, backend="cuda"), want)
        assert err <= 1e-5 * scale
