"""The CUDA decode attention merges its shares in the kernel: the last share of each (row, kv head)
to finish merges them and resets that pair's count for the next launch."""
from __future__ import annotations

import pytest
import torch

from soma_runtime.backends import run_op
from soma_runtime.ir.jets import max_error
from tests.backends import BACKENDS
from tests.backends.test_ops import kv_append_ref, long_decode_inputs, paged_attention_ref, rope_ref

pytestmark = pytest.mark.skipif("cuda" not in BACKENDS, reason="needs a GPU or Triton (interpreted)")


def test_consecutive_launches_each_merge_their_shares():
    """A count left over from one launch would make the next merge early, late or never."""
    first = long_decode_inputs()("f32")
    second = [first[0][:, ::-1].copy(), *first[1:]]                 # other queries, same cache
    for inputs in (first, second, first):
        want = paged_attention_ref()(*[torch.from_numpy(x) for x in inputs]).numpy()
        err, scale = max_error(run_op("paged_attention", *inputs, backend="cuda"), want)
        assert err <= 1e-5 * scale


def test_queries_keys_and_values_read_in_place_from_a_fused_qkv_product():
    """A batch's q, k and v are column ranges of one qkv product (its rows, not theirs, set the stride):
    the kernels read them where they lie, and get PyTorch's cache and attention, exactly what contiguous
    copies give (rows read as if packed would not)."""
    from soma_runtime.backends.cuda.attention import paged_attention
    from soma_runtime.backends.cuda.device import device
    from soma_runtime.backends.cuda.rope import kv_append
    rows, heads, kv_heads, dim = 3, 4, 2, 8
    generator = torch.Generator().manual_seed(0)
    qkv = torch.randn((rows, (heads + 2 * kv_heads) * dim), generator=generator)          # on the host, as the references run
    widths = [heads * dim, kv_heads * dim, kv_heads * dim]
    views = lambda x: [t.reshape(rows, n, dim) for t, n in zip(torch.split(x, widths, dim=1), (heads, kv_heads, kv_heads))]
    pages = torch.randn((2, 4, 4, kv_heads, dim), generator=generator)                     # keys, values: 16 slots
    slots, positions, inv_freq = torch.tensor([5, 0, 6]), torch.tensor([7, 8, 9]), torch.rand(dim // 2, generator=generator)
    ctx = torch.tensor([9, 10, 11, 5, 0, 1, 2, 3, 6])
    q, k, v = views(qkv.to(device()))
    assert not (q.is_contiguous() or k.is_contiguous() or v.is_contiguous())
    at = [t.to(device()) for t in (slots, positions, inv_freq, ctx)]
    results = []
    for q_in, k_in, v_in in ((q, k, v), (q.contiguous(), k.contiguous(), v.contiguous())):
        k_pages, v_pages = kv_append(pages[0].to(device(), copy=True), k_in, *at[:3], pages[1].to(device(), copy=True), v_in)
        out = paged_attention(q_in, k_pages, v_pages, at[3], None, None, at[1], at[2])
        results.append((k_pages, v_pages, out))
    for strided, packed in zip(*results):
        assert torch.equal(strided, packed)
    q, k, v = views(qkv)
    want_k = kv_append_ref(pages[0], rope_ref("neox", dim)(k, positions, inv_freq), slots)
    want_v = kv_append_ref(pages[1], v, slots)
    want = paged_attention_ref()(rope_ref("neox", dim)(q, positions, inv_freq), want_k, want_v, ctx, torch.zeros((1, 1, rows, 9)))
    for got, expected in zip(results[0], (want_k, want_v, want)):
        err, scale = max_error(got.cpu(), expected)
        assert err <= 1e-5 * scale
