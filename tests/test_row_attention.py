"""specdec::row_attention (runtime/attention.py): the fast path's attention kernel. It must compute scaled
dot-product attention, and compute every query row on its own: the same bits for a row whatever else the pass
holds (more rows, other batch rows, a longer cache, holes), which library kernels do not guarantee."""

import pytest
import torch
import torch.nn.functional as F

from specdec.runtime.rowwise import row_attention, row_invariant

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def reference(q, k, v, mask, scale=None):
    rep = q.shape[1] // k.shape[1]
    k, v = k.float().repeat_interleave(rep, 1), v.float().repeat_interleave(rep, 1)
    return F.scaled_dot_product_attention(q.float(), k, v, attn_mask=mask.float(), scale=scale)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim", [64, 20, 8])
@pytest.mark.parametrize("heads, kv_heads", [(6, 6), (4, 2)])
def test_computes_attention(dtype, head_dim, heads, kv_heads):
    q = torch.randn(2, heads, 5, head_dim).to(dtype)  # [B, H, M, D]
    k, v = (torch.randn(2, kv_heads, 40, head_dim).to(dtype) for _ in range(2))  # [B, Hkv, L, D]
    mask = torch.zeros(2, 1, 5, 40)
    mask[0, :, :, 30:] = float("-inf")
    mask[1, :, :, :3] = torch.finfo(torch.float32).min
    mask[1, :, 2, 10:20] = float("-inf")
    expected = reference(q, k, v, mask, scale=0.3)
    tol = 2e-6 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(row_attention(q, k, v, mask.to(dtype), 0.3).float(), expected, atol=tol, rtol=tol)
    # a boolean mask (True = attend), as some callers pass
    torch.testing.assert_close(row_attention(q, k, v, mask > -1, 0.3).float(), expected, atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_row_does_not_depend_on_the_rest_of_the_pass(dtype):
    """Row i of a pass equals the same row computed alone, in a batch, beside other rows, over a longer cache
    (extra masked slots) and with its valid slots spread over holes."""
    torch.manual_seed(1)
    heads, dim, slots, rows = 4, 32, 48, 9
    k, v = (torch.randn(1, heads, slots, dim).to(dtype) for _ in range(2))
    q = torch.randn(1, heads, rows, dim).to(dtype)
    mask = torch.full((1, 1, rows, slots), float("-inf"))
    for i in range(rows):
        mask[0, 0, i, : 30 + i] = 0.0  # row i sees slots 0..29+i
    full = row_attention(q, k, v, mask.to(dtype))
    for i in range(rows):
        alone = row_attention(q[:, :, i : i + 1], k, v, mask[:, :, i : i + 1].to(dtype))
        assert torch.equal(alone, full[:, :, i : i + 1]), f"row {i} alone"
    # in a batch of 3, as the middle row, next to unrelated rows and caches
    batch_q = torch.cat([torch.randn_like(q), q, torch.randn_like(q)])
    batch_kv = [torch.cat([torch.randn_like(t), t, torch.randn_like(t)]) for t in (k, v)]
    batch_mask = torch.cat([torch.zeros_like(mask), mask, torch.zeros_like(mask)])
    assert torch.equal(row_attention(batch_q, *batch_kv, batch_mask.to(dtype))[1:2], full)
    # a longer cache: 80 more slots, all masked
    longer = [torch.cat([t, torch.randn(1, heads, 80, dim).to(dtype)], dim=2) for t in (k, v)]
    longer_mask = torch.cat([mask, torch.full((1, 1, rows, 80), float("-inf"))], dim=-1)
    assert torch.equal(row_attention(q, *longer, longer_mask.to(dtype)), full)
    # the same keys and values in the same order, with masked holes between them
    spread = torch.arange(slots) * 2 + 1  # slot j moves to 2j + 1; even slots are holes of junk
    holey = [torch.randn(1, heads, 2 * slots + 1, dim).to(dtype) for _ in range(2)]
    for h, t in zip(holey, (k, v)):
        h[:, :, spread] = t
    holey_mask = torch.full((1, 1, rows, 2 * slots + 1), float("-inf"))
    holey_mask[..., spread] = mask
    assert torch.equal(row_attention(q, *holey, holey_mask.to(dtype)), full)


def test_the_mode_routes_sdpa_and_passes_through_what_it_cannot_serve():
    q, k, v = (torch.randn(1, 2, 3, 16) for _ in range(3))
    mask = torch.zeros(1, 1, 3, 3)
    with row_invariant():
        routed = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        causal = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # no mask: PyTorch's kernel
        double = F.scaled_dot_product_attention(q.double(), k.double(), v.double(), attn_mask=mask.double())
    assert torch.equal(routed, row_attention(q, k, v, mask))
    assert torch.equal(causal, F.scaled_dot_product_attention(q, k, v, is_causal=True))
    assert double.dtype == torch.float64
    torch.testing.assert_close(double.float(), routed, atol=1e-6, rtol=1e-6)


@pytest.mark.compile
def test_compiled_through_a_model_pass():
    """Under torch.compile the kernel stays one opaque call (fullgraph: no graph break) with the same bits."""
    q, k, v = (torch.randn(1, 2, 4, 16, dtype=torch.bfloat16) for _ in range(3))
    mask = torch.zeros(1, 1, 4, 4, dtype=torch.bfloat16)

    def attend(q, k, v, mask):
        with row_invariant():
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask) * 2

    eager = attend(q, k, v, mask)
    compiled = torch.compile(attend, fullgraph=True)(q, k, v, mask)
    assert torch.equal(compiled, eager)
