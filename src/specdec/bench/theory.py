"""Measurement beside theory (Leviathan et al. 2023): what α, c and γ predict, and what was measured.

With a per-token acceptance probability α (i.i.d.), γ drafts per round and a cost ratio c (time to draft
one token over the time of one target forward), a round yields on average
τ = (1 − α^(γ+1)) / (1 − α) tokens per target forward, and the expected speedup over plain decoding is
τ / (γc + 1). The formulas live in `specdec.core.stats`; this module applies them to measured α and c.

Which α: `DecodeStats.acceptance_rate` (accepted / drafted) counts the drafts after a rejection as
rejected although they were never tested, so it underestimates the per-token α of the model. The α fed
to the formulas is the per-token one, accepted / (accepted + rejections), the maximum-likelihood estimate
under the i.i.d. model; both are reported.
"""

from __future__ import annotations

from typing import Any

from specdec.core.stats import best_gamma, expected_speedup, expected_tokens_per_pass


def predict(alpha: float, gamma: int, cost_ratio: float | None) -> dict[str, float | None]:
    """Expected τ and speedup for per-token acceptance `alpha`, `gamma` drafts per round, cost ratio c."""
    tau = expected_tokens_per_pass(alpha, gamma)
    speedup = expected_speedup(alpha, gamma, cost_ratio) if cost_ratio is not None else None
    return {"alpha": alpha, "gamma": gamma, "cost_ratio": cost_ratio, "tau": tau, "speedup": speedup}


def recommended_gamma(alpha: float, cost_ratio: float, max_gamma: int = 16) -> int:
    """The γ maximising τ / (γc + 1) (0 when speculation cannot pay)."""
    return best_gamma(alpha, cost_ratio, max_gamma)


def _same_path_plain(method: str) -> str | None:
    """The plain decoding that runs on the same path as `method` (same runtime, same compiled passes)."""
    if method == "ov-speculative":
        return "ov-plain"
    return "plain-compiled" if method.endswith("-compiled") else None


def compare(summaries: list[dict[str, Any]], max_gamma: int = 16) -> dict[str, Any]:
    """Per fixed-γ config: measured vs predicted τ and speedup. Per method swept over γ: the γ the formula
    recommends (from α and c pooled over the sweep) vs the fastest γ measured.

    Measured speedups are against plain decoding on the same path (the same loop without drafting, which is
    what Leviathan's formula models): `plain-compiled` for a `-compiled` method and `ov-plain` for
    `ov-speculative` when it was run, else `plain`, else `hf-plain`; each row names its `baseline`.

    Units. c (`cost_ratio`) is drafting time per drafted token over the time of one target pass of the SAME
    run, i.e. a verification pass of γ+1 tokens. v (`verify_cost_ratio`) is that verification pass over the
    baseline's one-token pass. So a round costs γ·c·v + v one-token passes, c·v (`cost_ratio_per_plain_pass`)
    is the draft's cost per token in Leviathan's unit, and the prediction with the verification cost is
    τ / (v·(γc + 1)).
    """
    by_label = {s["label"]: s for s in summaries}
    base = by_label.get("plain") or by_label.get("hf-plain")
    rows = []
    for s in summaries:
        if s["gamma"] is None or s.get("alpha_token") is None:
            continue
        own = by_label.get(_same_path_plain(s["method"]) or "")
        row_base = own or base
        base_tps = row_base["tokens_per_s"] if row_base else None
        base_per_forward = row_base.get("target_s_per_forward") if row_base else None
        pred = predict(s["alpha_token"], s["gamma"], s.get("cost_ratio"))
        # How much dearer a verification pass of γ+1 tokens is than a plain one-token pass on the same path;
        # the formula assumes 1.0 (true for memory-bound GPUs, less so for a small model on a CPU).
        verify_cost = (s["target_s_per_forward"] / base_per_forward
                       if s.get("target_s_per_forward") and base_per_forward else None)
        known = verify_cost and s.get("cost_ratio") is not None
        adjusted = pred["tau"] / (verify_cost * (s["gamma"] * s["cost_ratio"] + 1)) if known else None
        rows.append({
            "label": s["label"], "method": s["method"], "gamma": s["gamma"],
            "baseline": row_base["label"] if row_base else None,
            "alpha": s.get("alpha"), "alpha_token": s["alpha_token"], "cost_ratio": s.get("cost_ratio"),
            "cost_ratio_per_plain_pass": s["cost_ratio"] * verify_cost if known else None,
            "mean_drafted_per_round": s.get("mean_drafted_per_round"),
            "tau_measured": s["tau"], "tau_predicted": pred["tau"],
            "speedup_measured": s["tokens_per_s"] / base_tps if base_tps else None,
            "speedup_predicted": pred["speedup"],
            "verify_cost_ratio": verify_cost, "speedup_predicted_with_verify_cost": adjusted,
        })
    methods: dict[str, Any] = {}
    for method in dict.fromkeys(s["method"] for s in summaries if s["gamma"] is not None):
        sweep = [s for s in summaries if s["method"] == method and s["gamma"] is not None]
        accepted = sum(s["accepted"] for s in sweep)
        tested = accepted + sum(s["rejections"] for s in sweep)
        drafted = sum(s["drafted"] for s in sweep)
        alpha = accepted / tested if tested else None
        cost = None  # the configs' c (medians over runs) averaged with weights = drafted tokens
        if drafted and all(s.get("cost_ratio") is not None for s in sweep):
            cost = sum(s["cost_ratio"] * s["drafted"] for s in sweep) / drafted
        best = max(sweep, key=lambda s: s["tokens_per_s"])
        methods[method] = {
            "gammas": [s["gamma"] for s in sweep],
            "alpha_token": alpha, "cost_ratio": cost,
            "gamma_recommended": recommended_gamma(alpha, cost, max_gamma) if alpha is not None and cost else None,
            "gamma_best_measured": best["gamma"],
            "best_tokens_per_s": best["tokens_per_s"],
        }
    return {"baseline": base["label"] if base else None, "configs": rows, "methods": methods}
