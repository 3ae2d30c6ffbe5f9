"""The warp equals transformers' Temperature → TopK → TopP warpers + softmax; sampling is unbiased."""

from __future__ import annotations

import pytest
import torch
from transformers import TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

from specdec.sampling import SamplingConfig, sample


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


def test_sample_follows_the_probabilities_and_never_draws_zero_mass():
    probs = torch.tensor([[0.1, 0.0, 0.6, 0.3]]).repeat(100_000, 1)
    counts = torch.bincount(sample(probs, torch.Generator().manual_seed(0)), minlength=4).double()
    assert counts[1] == 0
    assert torch.allclose(counts / counts.sum(), torch.tensor([0.1, 0.0, 0.6, 0.3], dtype=torch.float64),
                          atol=0.005)
    unnormalised = torch.tensor([[0.0, 0.0, 2.0, 0.0], [3.0, 0.0, 0.0, 0.0]])
    assert sample(unnormalised, torch.Generator().manual_seed(1)).tolist() == [2, 0]
