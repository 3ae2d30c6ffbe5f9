"""The warp written from its definition, in float64 NumPy: the exactness checks' own reference.

The decoder's `SamplingConfig.warp` is the code under test and is written for speed (it works on the top-k
or sorted candidates only). The reference distribution the exactness checks compare with must not share
that code, or a warp that is wrong on both sides would pass. So this module states the warp plainly, one
row at a time, over the whole vocabulary:

1. temperature: z = logits / T;
2. top-k: keep every token whose z is >= the k-th largest z (all tokens tied with the k-th are kept);
3. softmax over the kept tokens;
4. top-p: keep every token for which the probability of the tokens with a strictly larger z is < top_p
   (so the most likely token is always kept, and tied tokens are kept or dropped together);
5. softmax over the tokens still kept.

−inf logits get probability 0 and are never counted among the top k's ties. Temperature 0 is greedy: a
point mass on the first index of the largest logit (as `torch.argmax` and the greedy verifier). The tie
rule is discussed in docs/exactness.md ("The warp and its tie rule").
"""

from __future__ import annotations

import numpy as np


def reference_warp(
    logits: np.ndarray, temperature: float, top_k: int | None = None, top_p: float | None = None
) -> np.ndarray:
    """logits [n, V] (any float dtype, −inf allowed) -> the warped distribution, float64 [n, V]."""
    z = np.asarray(logits, dtype=np.float64)
    if z.ndim != 2:
        raise ValueError(f"logits must be [n, V], got shape {z.shape}")
    out = np.zeros_like(z)
    for r, row in enumerate(z):
        if temperature == 0.0:
            out[r, int(np.argmax(row))] = 1.0  # first index among the largest
        else:
            out[r] = _warp_row(row / temperature, top_k, top_p)
    return out


def _softmax(z: np.ndarray, keep: np.ndarray) -> np.ndarray:
    """Softmax of z over the tokens in `keep` (boolean [V]); 0 elsewhere."""
    e = np.zeros_like(z)
    e[keep] = np.exp(z[keep] - z[keep].max())
    return e / e.sum()


def _warp_row(z: np.ndarray, top_k: int | None, top_p: float | None) -> np.ndarray:
    keep = z > -np.inf  # [V]
    if not keep.any():
        raise ValueError("every logit is -inf: there is no distribution to sample from")
    if top_k is not None and top_k < keep.sum():
        kth = -np.partition(-z[keep], top_k - 1)[top_k - 1]  # the k-th largest finite value
        keep &= z >= kth
    probs = _softmax(z, keep)
    if top_p is not None and top_p < 1.0:
        # For each kept token, the probability of the tokens with a strictly larger z: sort descending; the
        # cumulative probability before the first token of a run of equal values is the mass above the run.
        cand = np.flatnonzero(keep)  # [m]
        order = cand[np.argsort(-z[cand])]  # [m], descending z
        zs = z[order]
        before = np.concatenate([[0.0], np.cumsum(probs[order])[:-1]])  # [m]: mass of the sorted tokens before
        run_start = np.maximum.accumulate(np.where(np.r_[True, zs[1:] != zs[:-1]], np.arange(zs.size), 0))
        keep[order[before[run_start] >= top_p]] = False
        probs = _softmax(z, keep)
    return probs
