"""The warp: the decoder's fast `SamplingConfig.warp`, the exactness suite's plain `reference_warp` and
transformers' Temperature → TopK → TopP warpers + softmax agree, edge cases included (tied logits, top-p
boundaries, top-k = V, T near 0, −inf logits); the tie rule; sampling is unbiased."""

from __future__ import annotations

import pytest
import torch
from transformers import TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

from specdec.core.sampling import SamplingConfig, sample
from specdec.exactness.warp import reference_warp


def hf_warp(logits, temperature, top_k, top_p):
    scores = TemperatureLogitsWarper(temperature)(None, logits.clone())
    if top_k is not None:
        scores = TopKLogitsWarper(top_k)(None, scores)
    if top_p is not None and top_p < 1.0:
        scores = TopPLogitsWarper(top_p)(None, scores)
    return torch.softmax(scores, dim=-1)


@pytest.mark.parametrize("temperature", [0.5, 1.0, 1.5])
@pytest.mark.parametrize(("top_k", "top_p"), [(None, None), (5, None), (None, 0.8), (40, 0.9), (3, 0.3),
                                              (1000, 0.95), (None, 1.0)])
def test_warp_matches_transformers(temperature, top_k, top_p):
    logits = torch.randn(6, 512, generator=torch.Generator().manual_seed(1), dtype=torch.float64) * 3
    ours = SamplingConfig(temperature, top_k, top_p).warp(logits)
    assert torch.allclose(ours, hf_warp(logits, temperature, top_k, top_p), atol=1e-12)
    assert torch.allclose(ours.sum(-1), torch.ones(6, dtype=torch.float64))


def ours(logits, temperature, top_k, top_p):
    return SamplingConfig(temperature, top_k, top_p).warp(logits)


def ref(logits, temperature, top_k, top_p):
    return torch.from_numpy(reference_warp(logits.numpy(), temperature, top_k, top_p))


def _logits(kind: str) -> torch.Tensor:
    gen = torch.Generator().manual_seed(7)
    if kind == "random":  # no ties
        return torch.randn(8, 12, generator=gen, dtype=torch.float64) * 2
    if kind == "wide":  # logits spread over hundreds of nats
        return torch.randn(8, 12, generator=gen, dtype=torch.float64) * 60
    if kind == "-inf":  # masked tokens, one row with a single finite logit, rows with fewer than k finite
        x = torch.randn(8, 12, generator=gen, dtype=torch.float64) * 2
        masked = torch.rand(8, 12, generator=gen) < 0.5
        masked[torch.arange(8), torch.arange(8) + 2] = False  # every row keeps a finite logit
        x[masked] = -torch.inf
        x[0, 1:] = -torch.inf
        x[0, 0] = 0.3
        x[1, 3:] = -torch.inf
        x[1, :3] = torch.tensor([0.5, -1.0, 2.0])  # 3 finite: fewer than k for k >= 4
        return x
    if kind == "ties":  # integer logits 0..3: ties at every boundary
        return torch.randint(0, 4, (200, 12), generator=gen).double()
    raise ValueError(kind)


V = 12
CONFIGS = [(None, None), (1, None), (3, None), (V - 1, None), (V, None), (V + 5, None), (None, 0.3),
           (None, 0.9), (3, 0.7), (V, 0.9), (None, 1.0), (5, 0.99)]


@pytest.mark.parametrize("kind", ["random", "wide", "-inf", "ties"])
@pytest.mark.parametrize("temperature", [0.25, 1.0, 3.0])
def test_warp_matches_the_reference_definition(kind, temperature):
    """The decoder's warp against the exactness suite's reference, written separately, on every edge case."""
    logits = _logits(kind)
    for top_k, top_p in CONFIGS:
        got, want = ours(logits, temperature, top_k, top_p), ref(logits, temperature, top_k, top_p)
        assert torch.allclose(got, want, atol=1e-12, rtol=0), (top_k, top_p)
        assert ((got > 0) == (want > 0)).all(), (top_k, top_p)  # the same support, not just close
        assert torch.allclose(want.sum(-1), torch.ones(len(logits), dtype=torch.float64))
        assert (want[logits == -torch.inf] == 0).all()


@pytest.mark.parametrize("kind", ["random", "wide", "-inf"])
@pytest.mark.parametrize("temperature", [0.25, 1.0, 3.0])
def test_reference_matches_transformers_without_ties(kind, temperature):
    logits = _logits(kind)
    for top_k, top_p in CONFIGS:
        hf = hf_warp(logits, temperature, top_k, top_p)
        assert torch.allclose(ref(logits, temperature, top_k, top_p), hf, atol=1e-12, rtol=0), (top_k, top_p)


def test_top_k_keeps_every_token_tied_with_the_kth_as_transformers():
    logits = _logits("ties")
    for temperature in (0.5, 1.0):
        for top_k in (1, 2, 3, 5, V - 1, V):
            want = hf_warp(logits, temperature, top_k, None)
            assert torch.allclose(ref(logits, temperature, top_k, None), want, atol=1e-12, rtol=0)
            assert torch.allclose(ours(logits, temperature, top_k, None), want, atol=1e-12, rtol=0)
    # One row, by hand: k = 2 with the 2nd and 3rd largest tied keeps three tokens.
    row = torch.tensor([[2.0, 1.0, 1.0, 0.0]], dtype=torch.float64)
    assert (ours(row, 1.0, 2, None) > 0).tolist() == [[True, True, True, False]]


def test_top_p_keeps_a_tied_group_together():
    """The tie rule at the top-p boundary: a token is kept while the mass of the tokens with a strictly
    larger logit is below top_p, so tied tokens are kept or dropped together. transformers keeps part of a
    tied group that straddles the boundary (which part depends on how torch.sort orders equal values): its
    support is then a subset of ours, and the extra tokens are tied with its smallest kept logit."""
    row = torch.tensor([[2.0] + [1.0] * 20 + [0.0]], dtype=torch.float64)
    assert (ours(row, 1.0, None, 0.5) > 0).sum() == 21  # the top token and all 20 tied ones
    logits = _logits("ties")
    straddled = 0
    for top_k, top_p in [(None, 0.3), (None, 0.5), (None, 0.9), (6, 0.6), (V, 0.8)]:
        got, hf = ours(logits, 1.0, top_k, top_p), hf_warp(logits, 1.0, top_k, top_p)
        for x, g, h in zip(logits, got, hf):
            floor = x[h > 0].min()
            assert ((g > 0) == (x >= floor) & ((top_k is None) | (x >= x.topk(min(top_k or V, V)).values[-1]))).all()
            if ((g > 0) != (h > 0)).any():
                straddled += 1
                assert ((h > 0) <= (g > 0)).all()
            else:
                assert torch.allclose(g, h, atol=1e-12, rtol=0)
    assert straddled > 0  # the data has groups straddling the boundary


def test_warp_depends_on_logit_values_not_token_ids():
    logits = _logits("ties")
    perm = torch.randperm(V, generator=torch.Generator().manual_seed(3))
    for top_k, top_p in CONFIGS:
        assert torch.allclose(ours(logits[:, perm], 1.0, top_k, top_p), ours(logits, 1.0, top_k, top_p)[:, perm],
                              atol=1e-12, rtol=0), (top_k, top_p)


def test_top_p_boundaries():
    """top_p just above / below the cumulative mass of the j most likely tokens keeps j + 1 / j tokens,
    in all three implementations."""
    logits = _logits("random")[:3]
    for temperature, top_k in [(1.0, None), (0.7, 6)]:
        for x in logits:
            probs = ref(x[None], temperature, top_k, None)[0]
            mass = probs.sort(descending=True).values.cumsum(0)
            for j in range(1, int((probs > 0).sum())):
                for top_p, kept in ((float(mass[j - 1]) + 1e-9, j + 1), (float(mass[j - 1]) - 1e-9, j)):
                    want = hf_warp(x[None], temperature, top_k, top_p)
                    assert int((want > 0).sum()) == kept
                    for impl in (ours, ref):
                        got = impl(x[None], temperature, top_k, top_p)
                        assert torch.allclose(got, want, atol=1e-12, rtol=0), (impl.__name__, j, top_p)


@pytest.mark.parametrize("temperature", [1e-2, 1e-4, 1e-7])
def test_temperature_near_zero_tends_to_the_argmax(temperature):
    logits = _logits("random")
    for top_k, top_p in [(None, None), (3, None), (None, 0.9)]:
        want = hf_warp(logits, temperature, top_k, top_p)
        for impl in (ours, ref):
            assert torch.allclose(impl(logits, temperature, top_k, top_p), want, atol=1e-12, rtol=0)
    if temperature <= 1e-4:  # the gaps between these logits are >> T: a point mass on the argmax
        assert (ours(logits, temperature, None, None).argmax(-1) == logits.argmax(-1)).all()
        assert torch.allclose(ours(logits, temperature, None, None).max(-1).values,
                              torch.ones(len(logits), dtype=torch.float64))
    tied = torch.tensor([[1.0, 3.0, 3.0, 2.0]], dtype=torch.float64)  # tied maxima share the mass
    for impl in (ours, ref):
        assert torch.allclose(impl(tied, temperature, None, None),
                              torch.tensor([[0.0, 0.5, 0.5, 0.0]], dtype=torch.float64), atol=1e-12)


def test_reference_warp_at_temperature_zero_is_the_first_argmax():
    logits = torch.tensor([[0.0, 2.0, 2.0], [5.0, 1.0, 5.0]], dtype=torch.float64)
    assert ref(logits, 0.0, None, None).tolist() == [[0.0, 1.0, 0.0], [1.0, 0.0, 0.0]]


def test_sample_follows_the_probabilities_and_never_draws_zero_mass():
    probs = torch.tensor([[0.1, 0.0, 0.6, 0.3]]).repeat(100_000, 1)
    counts = torch.bincount(sample(probs, torch.Generator().manual_seed(0)), minlength=4).double()
    assert counts[1] == 0
    assert torch.allclose(counts / counts.sum(), torch.tensor([0.1, 0.0, 0.6, 0.3], dtype=torch.float64),
                          atol=0.005)
    unnormalised = torch.tensor([[0.0, 0.0, 2.0, 0.0], [3.0, 0.0, 0.0, 0.0]])
    assert sample(unnormalised, torch.Generator().manual_seed(1)).tolist() == [2, 0]
