"""The row-invariant kernels (runtime/rowwise.py): specdec::row_attention and specdec::row_linear must compute
attention and linear layers, and compute every row on its own: the same bits for a row whatever else the pass holds
(more rows, other batch rows, a longer cache, holes), which library kernels do not guarantee."""

import os
import shutil
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from specdec.runtime import rowwise
from specdec.runtime.rowwise import (
    all_finite,
    argmax,
    argmax_finite,
    kernel_loaded,
    kernel_threads,
    load_kernel,
    openmp_flags,
    packed_linear_serves,
    row_attention,
    row_invariant,
    row_linear,
)

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
@pytest.mark.parametrize("shape", [(2, 4, 5), (2, 4, 1), (1, 4, 5), (2, 1, 1)])
def test_masks_per_batch_row_head_and_query_row_or_broadcast(dtype, shape):
    """A mask [B|1, H|1, M|1, L]: each query row reads its own mask row, whichever dimensions it is shared over."""
    torch.manual_seed(4)
    q = torch.randn(2, 4, 5, 24).to(dtype)  # [B, H, M, D]
    k, v = (torch.randn(2, 2, 40, 24).to(dtype) for _ in range(2))  # [B, Hkv, L, D]
    mask = torch.where(torch.rand(*shape, 40) < 0.6, 0.0, float("-inf"))  # [B|1, H|1, M|1, L]
    mask[..., 7] = 0.0  # every row sees a slot
    expected = reference(q, k, v, mask.expand(2, 4, 5, 40))
    tol = 2e-6 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(row_attention(q, k, v, mask.to(dtype)).float(), expected, atol=tol, rtol=tol)


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


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim", [64, 20, 8])
@pytest.mark.parametrize("heads, kv_heads", [(6, 6), (4, 2)])
def test_a_row_at_model_shapes_does_not_depend_on_the_rest_of_the_pass(dtype, head_dim, heads, kv_heads):
    """A slot cache as a model pass sees it: 130 causal query rows after a 61-slot prefix. Each row has the same
    bits in the full pass as in passes of 1, 3 or 7 rows (row and slot counts that are not multiples of the
    kernel's groups), over a 512-slot cache (masked junk after the visible slots), with every visible slot moved
    5 places on (another lane of its group of slots), and spread over holes (groups whose other slots are masked)."""
    torch.manual_seed(3)
    rows, past, slots = 130, 61, 200
    k, v = (torch.randn(1, kv_heads, slots, head_dim).to(dtype) for _ in range(2))  # [B, Hkv, L, D]
    q = torch.randn(1, heads, rows, head_dim).to(dtype)  # [B, H, M, D]
    masked = torch.finfo(dtype).min
    mask = torch.full((1, 1, rows, slots), masked, dtype=dtype)  # [B, 1, M, L]
    for i in range(rows):
        mask[0, 0, i, : past + i + 1] = 0  # row i sees slots 0..past+i
    full = row_attention(q, k, v, mask)
    tol = 2e-6 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(full.float(), reference(q, k, v, mask), atol=tol, rtol=tol)
    for n in (1, 3, 7):
        parts = [row_attention(q[:, :, s : s + n], k, v, mask[:, :, s : s + n]) for s in range(0, rows, n)]
        assert torch.equal(torch.cat(parts, dim=2), full), f"in passes of {n} rows"

    def moved(where, length):  # the cache with slot j at where[j], junk (masked) elsewhere
        kv = [torch.randn(1, kv_heads, length, head_dim).to(dtype) for _ in range(2)]
        for new, old in zip(kv, (k, v)):
            new[:, :, where] = old
        new_mask = torch.full((1, 1, rows, length), masked, dtype=dtype)
        new_mask[..., where] = mask
        return row_attention(q, *kv, new_mask)

    assert torch.equal(moved(torch.arange(slots), 512), full), "in a 512-slot cache"
    assert torch.equal(moved(torch.arange(slots) + 5, 512), full), "moved 5 slots on"
    assert torch.equal(moved(torch.arange(slots) * 5 // 2 + 3, 512), full), "spread over holes"
    bool_mask = mask == 0  # the same mask as booleans (True = attend)
    assert torch.equal(row_attention(q, k, v, bool_mask), full)
    alone = [row_attention(q[:, :, i : i + 1], k, v, bool_mask[:, :, i : i + 1]) for i in (0, 64, rows - 1)]
    assert all(torch.equal(a, full[:, :, i : i + 1]) for a, i in zip(alone, (0, 64, rows - 1)))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim", [128, 64])
def test_a_row_over_a_long_cache_does_not_depend_on_the_rest_of_the_pass(dtype, head_dim):
    """Over a long cache, rows whose visible slots start and end at different places (with a hole each), and whose
    values are summed two or four rows at a time, have the bits they have alone, in passes of 3 rows, and without
    the other query heads of their grouped-query kv head."""
    torch.manual_seed(5)
    heads, kv_heads, rows, slots = 6, 2, 8, 1300
    k, v = (torch.randn(1, kv_heads, slots, head_dim).to(dtype) for _ in range(2))  # [B, Hkv, L, D]
    q = torch.randn(1, heads, rows, head_dim).to(dtype)  # [B, H, M, D]
    mask = torch.full((1, 1, rows, slots), float("-inf"))  # [B, 1, M, L]
    for i in range(rows):
        mask[0, 0, i, 37 * i + 3 : 1100 + 29 * i] = 0.0  # row i sees its own window
        mask[0, 0, i, 500 + 11 * i : 540 + 11 * i] = float("-inf")  # and a hole in it
    full = row_attention(q, k, v, mask.to(dtype))
    tol = 2e-6 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(full.float(), reference(q, k, v, mask), atol=tol, rtol=tol)
    for i in range(rows):
        alone = row_attention(q[:, :, i : i + 1], k, v, mask[:, :, i : i + 1].to(dtype))
        assert torch.equal(alone, full[:, :, i : i + 1]), f"row {i} alone"
    parts = [row_attention(q[:, :, s : s + 3], k, v, mask[:, :, s : s + 3].to(dtype)) for s in range(0, rows, 3)]
    assert torch.equal(torch.cat(parts, dim=2), full), "in passes of 3 rows"
    one_head = row_attention(q[:, 4:5], k[:, 1:2], v[:, 1:2], mask.to(dtype))  # head 4 reads kv head 1
    assert torch.equal(one_head, full[:, 4:5]), "without the other query heads of its kv head"


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


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("k, n", [(384, 1024), (100, 37), (33, 5), (64, 8192)])
def test_linear_computes_x_wt_plus_b(dtype, k, n):
    x = torch.randn(2, 7, k).to(dtype)  # [..., K]
    w, b = torch.randn(n, k).to(dtype), torch.randn(n).to(dtype)
    expected = F.linear(x.double(), w.double(), b.double())
    tol = 1e-5 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(row_linear(x, w, b).double(), expected, atol=tol * k ** 0.5, rtol=tol)
    torch.testing.assert_close(row_linear(x, w).double(), expected - b.double(), atol=tol * k ** 0.5, rtol=tol)


@pytest.mark.parametrize("dtype", DTYPES)
def test_linear_row_does_not_depend_on_the_rest_of_the_pass(dtype):
    """Every row of a 13-row product equals that row computed alone or in any split of the rows (blocks of 4
    rows, partial blocks, another position in its block)."""
    torch.manual_seed(2)
    x, w = torch.randn(13, 200).to(dtype), torch.randn(300, 200).to(dtype)
    full = row_linear(x, w)
    for rows in (1, 2, 3, 5, 7):
        parts = torch.cat([row_linear(x[s : s + rows], w) for s in range(0, 13, rows)])
        assert torch.equal(parts, full), f"in passes of {rows} rows"
    shifted = row_linear(torch.cat([torch.randn(3, 200).to(dtype), x]), w)[3:]  # each row 3 places later
    assert torch.equal(shifted, full)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("k, n", [(389, 203), (1024, 64), (37, 21)])
def test_linear_row_does_not_depend_on_the_rest_of_a_long_pass(dtype, k, n):
    """A prefill-sized product (~200 rows: many row chunks and blocks; K and N not multiples of any block or vector
    size) equals its rows computed alone, in passes of 5 to 7 rows, in uneven slices that cross chunk and block
    boundaries, shifted, and with the outputs split into slices of the weight."""
    torch.manual_seed(3)
    x, w = torch.randn(203, k).to(dtype), torch.randn(n, k).to(dtype)  # [M, K], [N, K]
    b = torch.randn(n).to(dtype)
    full = row_linear(x, w, b)  # [M, N]
    for i in (0, 1, 31, 32, 33, 100, 202):
        assert torch.equal(row_linear(x[i : i + 1], w, b), full[i : i + 1]), f"row {i} alone"
    for rows in (5, 7):
        parts = torch.cat([row_linear(x[s : s + rows], w, b) for s in range(0, 203, rows)])
        assert torch.equal(parts, full), f"in passes of {rows} rows"
    cuts = [0, 3, 30, 37, 64, 65, 130, 199, 203]
    parts = torch.cat([row_linear(x[s:e], w, b) for s, e in zip(cuts, cuts[1:])])
    assert torch.equal(parts, full), "in uneven slices"
    shifted = row_linear(torch.cat([torch.randn(13, k).to(dtype), x]), w, b)[13:]  # each row 13 places later
    assert torch.equal(shifted, full)
    cols = [0, 1, 6, 17, n]  # output slices of the weight, each at another offset in its own blocks
    parts = torch.cat([row_linear(x, w[s:e], b[s:e]) for s, e in zip(cols, cols[1:])], dim=1)
    assert torch.equal(parts, full), "with the outputs split"


def test_the_mode_routes_linear_only_when_asked():
    x, w = torch.randn(3, 16), torch.randn(8, 16)
    with row_invariant():
        library = F.linear(x, w)
    with row_invariant(linear=True):
        routed = F.linear(x, w)
        double = F.linear(x.double(), w.double())  # float64: PyTorch's kernel
    assert torch.equal(library, F.linear(x, w))
    assert torch.equal(routed, row_linear(x, w))
    assert double.dtype == torch.float64


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "f32"])
@pytest.mark.parametrize("k, n", [(384, 1152), (389, 203), (37, 21), (128, 8192)])
def test_packed_linear_computes_x_wt_plus_b_with_rows_that_do_not_depend_on_the_pass(k, n, dtype):
    """The kernel on packed weights (K odd, N not a multiple of a panel included): x wᵀ + b, and every row the same
    bits alone, in passes of 1 to 17 rows and shifted. (kernels/test/ checks its bits against a scalar reference on
    every tier: tests/test_kernel_tiers.py.)"""
    assert packed_linear_serves(torch.zeros(1, 1, dtype=dtype))
    load_kernel()
    torch.manual_seed(4)
    tol = 3e-2 if dtype == torch.bfloat16 else 1e-5
    x = torch.randn(45, k).to(dtype)  # [M, K]
    w, b = torch.randn(n, k).to(dtype), torch.randn(n).to(dtype)
    packed = torch.ops.specdec.pack_weight(w)
    full = torch.ops.specdec.packed_linear(x, packed, b, n)  # [M, N]
    assert full.dtype == dtype
    expected = F.linear(x.double(), w.double(), b.double())
    torch.testing.assert_close(full.double(), expected, atol=tol * k ** 0.5, rtol=tol)
    no_bias = torch.ops.specdec.packed_linear(x, packed, None, n)
    torch.testing.assert_close(no_bias.double(), expected - b.double(), atol=tol * k ** 0.5, rtol=tol)
    for rows in (1, 3, 4, 5, 6, 7, 8, 9, 12, 13, 17):  # AVX2: 4 rows on 3 panels, 5-6 on 2 (weights first); 7 on 1
        parts = torch.cat([torch.ops.specdec.packed_linear(x[s : s + rows], packed, b, n) for s in range(0, 45, rows)])
        assert torch.equal(parts, full), f"in passes of {rows} rows"
    shifted = torch.ops.specdec.packed_linear(torch.cat([torch.randn(5, k).to(dtype), x]), packed, b, n)
    assert torch.equal(shifted[5:], full)


def _dot_pairs(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """AVX512_BF16's dot product over k in pairs from zero, x [M, K] @ w [N, K]^T in float32: per pair the odd
    product added, then the even one, each sum rounded once (the products of bfloat16 values are exact; no input here
    is denormal, which the instruction would flush)."""
    total = torch.zeros(x.shape[0], w.shape[0])
    for j in range(0, x.shape[1], 2):
        if j + 1 < x.shape[1]:
            total = total + torch.outer(x[:, j + 1], w[:, j + 1])
        total = total + torch.outer(x[:, j], w[:, j])
    return total


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "f32"])
@pytest.mark.parametrize("k, n, group", [(389, 203, 64), (96, 70, 32), (37, 21, 2)])
def test_quantized_weights_sum_each_group_then_take_its_scale(k, n, group, dtype, bits):
    """int8 / int4 packed weights (the contract of kernels/packed_core.h): each group's products with the integers q
    summed from zero as the float32 kernel sums them (in a bfloat16 pass on AVX512_BF16: as its dot product sums
    pairs), then one multiply-add with the group's scale, in float32 and bfloat16 passes of any number of rows;
    close to float32 on q · scale. And bfloat16 weights in a float32 pass: the float32 kernel on the bfloat16
    values."""
    from specdec.runtime.weights import quantize_weight

    load_kernel()
    torch.manual_seed(7)
    x, w, b = torch.randn(30, k), torch.randn(n, k), torch.randn(n)
    qw = quantize_weight(w, bits, group)
    packed = torch.ops.specdec.pack_quantized(qw.q, qw.scales, bits, group)
    xd, bd = x.to(dtype), b.to(dtype)
    got = torch.ops.specdec.packed_linear(xd, packed, bd, n)
    pairs_tier = torch.ops.specdec.pack_weight(torch.ones(1, 2, dtype=torch.bfloat16)).dim() == 4  # AVX512_BF16
    acc = torch.zeros(30, n, dtype=torch.float64)
    for g, s in enumerate(range(0, k, group)):  # the group's sum, then fma in float64
        if dtype == torch.bfloat16 and pairs_tier:  # weight_only_pairs: the dot product's pairs
            total = _dot_pairs(xd[:, s : s + group].float(), qw.q[:, s : s + group].float())
        else:  # the float32 kernel's sum
            part = torch.ops.specdec.pack_weight(qw.q[:, s : s + group].float())
            total = torch.ops.specdec.packed_linear(xd[:, s : s + group].float().contiguous(), part, None, n)
        acc = (total.double() * qw.scales[:, g].double() + acc).float().double()  # one rounding but for ties of two
    want = acc.float() + bd.float()
    assert got.dtype == dtype and torch.equal(got, want.to(dtype))
    dequantized = torch.ops.specdec.packed_linear(xd.float(), torch.ops.specdec.pack_weight(qw.dequantize()),
                                                  bd.float(), n)
    scale = dequantized.abs().max().item()  # both round differently: close against the outputs' size
    torch.testing.assert_close(got.float(), dequantized.to(dtype).float(), rtol=1e-5 if dtype == torch.float32 else
                               8e-3, atol=1e-5 * scale)
    for rows in (1, 4, 5, 6, 8, 12, 13):
        parts = torch.cat([torch.ops.specdec.packed_linear(xd[s : s + rows], packed, bd, n) for s in range(0, 30, rows)])
        assert torch.equal(parts, got), f"in passes of {rows} rows"
    wb = w.bfloat16()  # packed without pairs, as load(weights="bfloat16") packs them: a float32 pass reads them
    mixed = torch.ops.specdec.packed_linear(x, torch.ops.specdec.pack_weight(wb, False), b, n)
    assert torch.equal(mixed, torch.ops.specdec.packed_linear(x, torch.ops.specdec.pack_weight(wb.float()), b, n))
    pairs = torch.ops.specdec.pack_weight(wb)
    if pairs.dim() == 4:  # AVX512_BF16's pairs, for its bfloat16 dot product: a float32 pass is refused, by name
        with pytest.raises(RuntimeError, match="bfloat16 pairs need bfloat16 input"):
            torch.ops.specdec.packed_linear(x, pairs, b, n)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "f32"])
@pytest.mark.parametrize("k, n, group", [(389, 203, 64), (96, 70, 32), (37, 21, 8)])
@pytest.mark.parametrize("bits", [4, 8], ids=["w4a8", "w8a8"])
def test_the_integer_formats_are_the_dot_product_of_their_weights_and_int8_rows(k, n, group, dtype, bits):
    """W4A8 and W8A8 (kernels/packed_core.h): each row's groups of inputs rounded to int8 at 127 / max|x|, integer
    sums against the int4 / int8 weights, one float32 multiply-add per group; rows that do not depend on the pass (1
    to 13 rows, and a prefill's blocks), close to float32 on the dequantized weights, and a non-finite input's row
    non-finite."""
    from specdec.runtime.weights import quantize_weight

    load_kernel()
    torch.manual_seed(11)
    x, w, b = torch.randn(30, k), torch.randn(n, k), torch.randn(n)
    x[3, : min(k, group)] = 0.0  # a group of zeros
    qw = quantize_weight(w, bits, group)
    packed = torch.ops.specdec.pack_quantized(qw.q, qw.scales, bits, group, True)
    xd, bd = x.to(dtype), b.to(dtype)
    got = torch.ops.specdec.packed_linear(xd, packed, bd, n)
    # the reference: the rows quantized as the kernel defines it, integer sums, float64 multiply-adds per group
    groups = -(-k // group)
    xf = torch.zeros(30, groups * group)
    xf[:, :k] = xd.float()
    xg = xf.view(30, groups, group)
    amax = xg.abs().amax(-1, keepdim=True)  # [M, groups, 1]
    xq = torch.where(amax > 0, torch.round(xg * 127 / amax.clamp_min(1e-45)), torch.zeros(()))
    qg = torch.zeros(n, groups * group, dtype=torch.int64)
    qg[:, :k] = qw.q.long()
    isum = torch.einsum("mgi,ngi->mng", xq.long().double(), qg.view(n, groups, group).double())  # exact
    scale = qw.scales.unsqueeze(0) * (amax.squeeze(-1) / 127).unsqueeze(1)  # [M, N, groups] float32
    want = torch.zeros(30, n)
    for g in range(groups):  # fma in float64, rounded to float32 (one rounding but for ties of two)
        want = (isum[:, :, g] * scale[:, :, g].double() + want.double()).float()
    want = want + bd.float()
    torch.testing.assert_close(got.float(), want.to(dtype).float(), rtol=1e-6 if dtype == torch.float32 else 8e-3,
                               atol=1e-6)
    float_kernel = torch.ops.specdec.packed_linear(xd.float(), torch.ops.specdec.pack_weight(qw.dequantize()),
                                                   bd.float(), n)
    assert (got.float() - float_kernel).abs().max() < 0.05 * float_kernel.abs().max()  # the inputs' rounding only
    for rows in (1, 3, 5, 8, 9, 12, 13):
        parts = torch.cat([torch.ops.specdec.packed_linear(xd[s : s + rows], packed, bd, n) for s in range(0, 30, rows)])
        assert torch.equal(parts, got), f"in passes of {rows} rows"
    bad = xd.clone()
    bad[2, k // 2] = float("nan")
    out = torch.ops.specdec.packed_linear(bad, packed, bd, n)
    assert out[2].isnan().all() and torch.equal(out[:2], got[:2]) and torch.equal(out[3:], got[3:])
    with pytest.raises(RuntimeError, match="a multiple of 8 for 4 bits and of 4 for 8 bits"):
        torch.ops.specdec.pack_quantized(qw.q, qw.scales, bits, 12 if bits == 4 else 6, True)


def test_quantization_levels_and_errors():
    """int8: scale max|w| / 127; int4: the group's extreme weight lands on -8; zeros stay zeros; bad arguments
    raise ConfigError naming the fix, and packed weights of another input size are refused."""
    from specdec.errors import ConfigError
    from specdec.runtime.weights import quantize_weight

    load_kernel()
    w = torch.tensor([[0.5, -1.0, 0.25, 0.0], [0.0, 0.0, 0.0, 0.0]])
    q8 = quantize_weight(w, 8, 4)
    assert q8.q[0].tolist() == [64, -127, 32, 0] and q8.q[1].tolist() == [0, 0, 0, 0]
    torch.testing.assert_close(q8.scales[0, 0], torch.tensor(1.0 / 127))
    q4 = quantize_weight(w, 4, 2)
    assert q4.q[0].tolist() == [4, -8, -8, 0] and torch.equal(q4.dequantize()[1], torch.zeros(4))
    assert (q4.dequantize()[0] - w[0]).abs().max() <= 0.125 / 2 + 1e-6
    with pytest.raises(ConfigError, match="even"):
        quantize_weight(w, 4, 3)
    with pytest.raises(ConfigError, match="8 or 4"):
        quantize_weight(w, 3, 4)
    packed = torch.ops.specdec.pack_quantized(q8.q, q8.scales, 8, 4)
    with pytest.raises(RuntimeError, match="another input size"):
        torch.ops.specdec.packed_linear(torch.randn(1, 9), packed, None, 2)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("width", [1, 5, 64, 65, 200, 8192, 8193])
def test_argmax_finite_is_torch_argmax_and_isfinite_in_one_read(dtype, width):
    """specdec::argmax_finite: the first index of each row's maximum (ties, -0 == +0, included), and whether
    every value is finite; any inf or NaN, wherever it is, clears the flag."""
    torch.manual_seed(5)
    x = torch.randn(8, width).to(dtype)  # [M, V]
    if width > 3:  # each row's maximum again in its middle and at its end: the first copy wins
        x[:, width // 2] = x.amax(-1)
        x[:, -1] = x.amax(-1)
    best, finite = argmax_finite(x)
    assert torch.equal(best, x.argmax(-1)) and best.dtype == torch.long and bool(finite)
    signed_zeros = torch.zeros(2, width, dtype=dtype)
    signed_zeros[0, width - 1] = -0.0
    signed_zeros[1, 0] = -0.0
    assert torch.equal(argmax_finite(signed_zeros)[0], signed_zeros.argmax(-1))
    for bad in (float("inf"), float("-inf"), float("nan")):
        for row, col in ((0, 0), (7, width - 1), (3, width // 2)):
            y = x.clone()
            y[row, col] = bad
            assert not bool(argmax_finite(y)[1]), (bad, row, col)


@pytest.mark.parametrize("dtype", [*DTYPES, torch.float64])
def test_argmax_and_all_finite_answer_as_torch_does_with_or_without_the_kernel(dtype):
    """`argmax` and `all_finite` (the batched round's greedy argmax and finiteness check) are torch.argmax(-1)
    and torch.isfinite(...).all() on any input: the kernel's read where it serves, torch's own where a value is
    not finite (the kernel's indices are unspecified there) or the dtype is not the kernel's; strided input too."""
    load_kernel()
    assert kernel_loaded()  # so the kernel's read serves the dtypes it takes
    torch.manual_seed(6)
    x = torch.randn(4, 3, 300).to(dtype)  # [B, W, V]
    x[1, 2, 7] = x[1, 2].amax() + 1
    for logits in (x, x[:, :2], x.transpose(0, 1)):
        assert torch.equal(argmax(logits), logits.argmax(-1)) and all_finite(logits)
    for bad in (float("nan"), float("inf"), float("-inf")):
        y = x.clone()
        y[2, 1, 11] = bad  # PyTorch's answers (a NaN is a maximum to torch.argmax), not the kernel's
        assert torch.equal(argmax(y), y.argmax(-1)) and not all_finite(y)


def test_argmax_and_all_finite_never_build_or_load_the_kernels():
    """A path that never used the kernels (float32 eager decoding; a machine that cannot build them) keeps
    PyTorch's reductions: the round's argmax and finiteness check load nothing (a fresh process)."""
    code = ("import torch\n"
            "from specdec.runtime.rowwise import all_finite, argmax, kernel_loaded\n"
            "x = torch.randn(3, 50)\n"
            "assert torch.equal(argmax(x), x.argmax(-1)) and all_finite(x)\n"
            "assert not kernel_loaded()\n")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


@pytest.fixture
def threads():
    """Sets torch's thread count for a test (the suite runs on 1: conftest.py) and restores it."""
    before = torch.get_num_threads()
    yield torch.set_num_threads
    torch.set_num_threads(before)


@pytest.mark.skipif(not openmp_flags(), reason="the kernels are built without OpenMP here (runtime/rowwise.py)")
def test_the_kernels_split_a_call_among_torchs_threads(threads):
    """Built with OpenMP, the kernels' parallel_for runs on torch's threads: without `-fopenmp` it compiled to one
    serial loop and specdec decoded on one core at any --threads."""
    for n in (1, 2, 3):
        threads(n)
        assert kernel_threads() == n


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "f32"])
def test_every_kernel_gives_the_same_bits_on_any_number_of_threads(dtype, threads):
    """Each thread computes whole panels, heads or rows, so a split among threads cannot change a bit: packed_linear
    in every format, row_linear and row_attention (and argmax_finite, one thread always) on 1, 2 and 3 threads, in
    passes of 1 and 9 rows."""
    from specdec.runtime.weights import quantize_weight

    load_kernel()
    torch.manual_seed(11)
    k, n = 200, 1000  # several units of work per thread at every pass width
    w, b = torch.randn(n, k), torch.randn(n).to(dtype)
    packs = {"float": torch.ops.specdec.pack_weight(w.to(dtype), False)}
    for bits in (8, 4):
        qw = quantize_weight(w, bits, 64)
        packs[f"int{bits}"] = torch.ops.specdec.pack_quantized(qw.q, qw.scales, bits, 64)
    q, kv = torch.randn(1, 8, 9, 32).to(dtype), torch.randn(2, 1, 4, 40, 32).to(dtype)  # [B, H, M, D], [2][B, Hkv, L, D]
    mask = torch.randn(1, 1, 9, 40).to(dtype)

    def run(rows: int) -> list[torch.Tensor]:
        x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows)).to(dtype)  # [M, K]
        out = [torch.ops.specdec.packed_linear(x, p, b, n) for p in packs.values()]
        out += [row_linear(x, w.to(dtype), b), argmax_finite(out[0])[0]]
        return [*out, row_attention(q[:, :, :rows], kv[0], kv[1], mask[:, :, :rows])]

    for rows in (1, 9):
        threads(1)
        alone = run(rows)
        for count in (2, 3):
            threads(count)
            assert all(torch.equal(a, b) for a, b in zip(alone, run(rows), strict=True)), (rows, count)


@pytest.mark.parametrize("fmt", ["bfloat16", "bfloat16-pairs", "float32", "w8a8"])
def test_a_weight_that_streams_from_memory_gives_the_bits_of_a_small_one(fmt):
    """A packed weight that streams from memory (kernels/packed_core.h, `streams`: 8 MiB or more, W8A8's 4 MiB)
    reads fewer panels side by side, and a one-row W8A8 or BF16_PAIRS pass over it runs as a block of two rows where
    the core's `DotStreaming` takes the twin row (an AMD core on AVX-512; kernels/test runs it on every AVX-512 tier):
    the same bits as the same outputs packed as a small weight, at every pass width. ("bfloat16-pairs": AVX512_BF16's
    pairs layout where the tier has it, else the plain bfloat16 one.)"""
    from specdec.runtime.weights import quantize_weight

    load_kernel()
    torch.manual_seed(12)
    k, n = 1024, 4200  # 8.6 MB in bfloat16, 17 MB in float32, 4.6 MB in W8A8
    dtype = torch.float32 if fmt == "float32" else torch.bfloat16
    w, b = torch.randn(n, k).to(dtype), torch.randn(n).to(dtype)
    if fmt == "w8a8":
        qw = quantize_weight(w.float(), 8, 64)
        big = torch.ops.specdec.pack_quantized(qw.q, qw.scales, 8, 64, True)
        small = torch.ops.specdec.pack_quantized(qw.q[:96], qw.scales[:96], 8, 64, True)
    else:
        pairs = fmt == "bfloat16-pairs"
        big, small = torch.ops.specdec.pack_weight(w, pairs), torch.ops.specdec.pack_weight(w[:96], pairs)
    least = 4 << 20 if fmt == "w8a8" else 8 << 20
    assert big.numel() * big.element_size() >= least > small.numel() * small.element_size()
    for rows in (1, 2, 5, 12, 13):
        x = torch.randn(rows, k).to(dtype)
        want = torch.ops.specdec.packed_linear(x, small, b[:96], 96)
        assert torch.equal(torch.ops.specdec.packed_linear(x, big, b, n)[:, :96], want), rows


def test_another_ninja_builds_apart(tmp_path, monkeypatch):
    """A build made by one ninja is rebuilt whole by another version (it does not read the other's build log), so
    the kernels of each ninja on PATH get a build directory of their own: an activated environment (its pip-installed
    ninja first on PATH) and a plain shell (the system's) no longer rebuild each other's kernels at every switch. The
    kernels' version, which keys compiled graphs and precision measurements, does not depend on it."""
    tier = rowwise.kernel_tier()
    here, version = rowwise.build_name.__wrapped__(tier), rowwise.kernels_version(tier)
    fake = tmp_path / "bin" / "ninja"
    fake.parent.mkdir()
    fake.write_text("#!/bin/sh\necho 0.0.1-another\n")
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{fake.parent}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setattr(rowwise, "ninja_version", rowwise.ninja_version.__wrapped__)  # uncached: this PATH
    assert rowwise.ninja_version() == "0.0.1-another"
    elsewhere = rowwise.build_name.__wrapped__(tier)
    assert elsewhere != here and elsewhere.startswith(f"specdec_kernels_{tier}_")
    assert rowwise.build_name.__wrapped__(tier) == elsewhere
    assert rowwise.kernels_version(tier) == version


def test_two_copies_of_the_same_kernel_sources_build_apart(tmp_path, monkeypatch):
    """Another checkout or install of the same sources gets a build directory of its own (torch's build names each
    source by its path, so one shared build was rebuilt whenever a process of the other copy loaded it: ~30 s each
    time on a 2-core Xeon), and the same kernels' version, which keys compiled graphs and precision measurements;
    the same copy keeps its one name."""
    tier = rowwise.kernel_tier()
    here, version = rowwise.build_name.__wrapped__(tier), rowwise.kernels_version.__wrapped__(tier)
    assert rowwise.build_name.__wrapped__(tier) == here
    copy = tmp_path / "kernels"
    shutil.copytree(rowwise.KERNELS, copy)
    monkeypatch.setattr(rowwise, "SOURCES", [copy / path.name for path in rowwise.SOURCES])
    monkeypatch.setattr(rowwise, "HEADERS", [copy / path.name for path in rowwise.HEADERS])
    monkeypatch.setattr(rowwise, "kernels_version", rowwise.kernels_version.__wrapped__)  # uncached: these sources
    elsewhere = rowwise.build_name.__wrapped__(tier)
    assert elsewhere != here and elsewhere.startswith(f"specdec_kernels_{tier}_")
    assert rowwise.kernels_version(tier) == version
    (copy / "simd.h").write_text((copy / "simd.h").read_text() + "\n// changed\n")
    assert rowwise.kernels_version(tier) != version
