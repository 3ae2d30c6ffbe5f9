"""Benchmark output: markdown tables, `results.json` (everything, raw timings included) and PNG plots."""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
from pathlib import Path
from typing import Any

from specdec.bench.runner import SLOW_RUN_FACTOR
from specdec.runtime.precision import cpu_family_model, cpu_model
from specdec.runtime.rowwise import kernel_threads, kernel_tier

PLOTS = {
    "speedup": "speedup_vs_gamma.png",
    "tau": "tau_measured_vs_predicted.png",
    "acceptance": "acceptance_by_position.png",
}


def machine_info(device: str = "cpu") -> dict[str, Any]:
    import torch
    import transformers

    import specdec

    info: dict[str, Any] = {
        "cpu": cpu_model(),
        "cpu_family_model": cpu_family_model(),
        "kernel_tier": kernel_tier(),  # the row-invariant kernels' ISA tier built and run here (docs/kernels.md)
        "cpu_count": os.cpu_count(),
        "affinity_cpus": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
        "torch_threads": torch.get_num_threads(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "specdec": specdec.__version__,
        "device": device,
    }
    if str(device) == "cpu":
        info["kernel_threads"] = kernel_threads()  # the threads specdec's kernels split a call among at that count
    if str(device).startswith("cuda") and torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name()
    try:
        root = Path(__file__).resolve().parents[3]
        commit = subprocess.run(["git", "-C", str(root), "rev-parse", "--short", "HEAD"], capture_output=True,
                                text=True, timeout=5)
        if commit.returncode == 0:
            info["git_commit"] = commit.stdout.strip()
    except (OSError, subprocess.SubprocessError):
        pass
    return info


def command_line() -> str:
    import shlex

    argv = list(sys.argv)
    if argv and Path(argv[0]).name in ("specdec", "__main__.py"):
        argv[0] = "specdec"
    return " ".join(shlex.quote(a) for a in argv)


# --------------------------------------------------------------------------------------------- tables


def _fmt(value: Any, digits: int = 2, suffix: str = "") -> str:
    if value is None:
        return "n/a"
    if isinstance(value, bool):
        return "yes" if value else "**NO**"
    if isinstance(value, float):
        return f"{value:.{digits}f}{suffix}"
    return f"{value}{suffix}"


def _table(header: list[str], rows: list[list[str]]) -> str:
    rule = "|" + "|".join("---:" if i else ":---" for i in range(len(header))) + "|"
    lines = ["| " + " | ".join(header) + " |", rule]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


def results_table(results: dict[str, Any]) -> str:
    greedy = results["settings"]["temperature"] == 0.0
    header = ["method", "γ", "tok/s (median)", "vs hf-plain", "vs plain", "τ", "α", "α/token",
              "c (÷ its verify pass)", "target fwd", "time: target / draft / other"]
    if greedy:
        header += ["= hf-plain", "= plain, same path"]
    rows = []
    for s in results["configs"]:
        split = " / ".join(f"{100 * s[k]:.0f}%" if s.get(k) is not None else "n/a"
                           for k in ("target_share", "draft_share", "other_share"))
        row = [s["method"], _fmt(s["gamma"]) if s["gamma"] else "–", _fmt(s["tokens_per_s"], 1),
               _fmt(s.get("speedup_vs_hf_plain"), 2, "x"), _fmt(s.get("speedup_vs_plain"), 2, "x"),
               _fmt(s["tau"]), _fmt(s["alpha"]), _fmt(s["alpha_token"]), _fmt(s["cost_ratio"], 3),
               str(s["target_forwards"]), split]
        if greedy:
            row += [_fmt(s["identical_to_hf_plain"]), _fmt(s.get("identical_to_plain"))]
        rows.append(row)
    return _table(header, rows)


def theory_table(theory: dict[str, Any]) -> str:
    rows = [[r["method"], str(r["gamma"]), _fmt(r["alpha_token"]), _fmt(r["cost_ratio"], 3),
             _fmt(r.get("cost_ratio_per_plain_pass"), 3), _fmt(r["tau_measured"]), _fmt(r["tau_predicted"]),
             _fmt(r.get("baseline")), _fmt(r["speedup_measured"], 2, "x"), _fmt(r["speedup_predicted"], 2, "x"),
             _fmt(r["verify_cost_ratio"]), _fmt(r["speedup_predicted_with_verify_cost"], 2, "x")]
            for r in theory["configs"]]
    header = ["method", "γ", "α/token", "c (÷ its verify pass)", "c·v (÷ plain pass)", "τ measured",
              "τ predicted", "baseline (plain, same path)", "speedup vs baseline", "predicted τ/(γc+1)",
              "v (verify pass ÷ baseline's pass)", "predicted τ/(v(γc+1))"]
    text = _table(header, rows) if rows else "(no fixed-γ drafting method was run)"
    method_rows = [[m, ",".join(map(str, v["gammas"])), _fmt(v["alpha_token"]), _fmt(v["cost_ratio"], 3),
                    _fmt(v["gamma_recommended"]), _fmt(v["gamma_best_measured"])]
                   for m, v in theory["methods"].items()]
    if method_rows:
        text += "\n\n" + _table(["method", "γ swept", "α/token (pooled)", "c (pooled)", "γ by formula",
                                 "fastest γ measured"], method_rows)
    return text


def _cpu_detail(machine: dict[str, Any]) -> str:
    """"family F model M, kernels: TIER tier, " as far as the results know them (older results: nothing)."""
    family = f"{machine['cpu_family_model']}, " if machine.get("cpu_family_model") else ""
    tier = f"kernels: {machine['kernel_tier']} tier, " if machine.get("kernel_tier") else ""
    return family + tier


def _where(machine: dict[str, Any]) -> str:
    """"CPU (family F model M, kernels: TIER tier, cpu" or, on a GPU, "GPU (cuda, host CPU family F model M"."""
    if machine.get("gpu"):
        return f"{machine['gpu']} ({machine.get('device', '?')}, host {machine.get('cpu', '?')} " + (
            machine.get("cpu_family_model") or "").strip()
    return f"{machine.get('cpu', '?')} ({_cpu_detail(machine)}{machine.get('device', '?')}"


def markdown(results: dict[str, Any]) -> str:
    st = results["settings"]
    machine = results.get("machine", {})
    sampling = "greedy" if st["temperature"] == 0.0 else (
        f"T={st['temperature']}" + (f", top-k={st['top_k']}" if st["top_k"] else "")
        + (f", top-p={st['top_p']}" if st["top_p"] else ""))
    head = (f"**{results.get('workload', 'prompts')}** workload, {len(results['prompts'])} prompts × "
            f"{st['repeats']} repeats (+{st['warmup']} warm-up), {st['max_new_tokens']} new tokens, {sampling}, "
            f"{results.get('models', {}).get('target', {}).get('dtype', '?').replace('torch.', '')}, "
            f"on {_where(machine)}, "
            f"torch {machine.get('torch', '?')}, "
            f"transformers {machine.get('transformers', '?')})")
    parts = [head, "", results_table(results), "", "Theory (Leviathan et al.): α/token and c measured, "
             "τ = (1−α^(γ+1))/(1−α), speedup = τ/(γc+1); c = drafting time per token ÷ one target pass of the same "
             "run (a γ+1-token verification pass); v = that pass ÷ a one-token pass of plain decoding on the same "
             "path (plain-compiled for -compiled methods).",
             "", theory_table(results["theory"])]
    costs = results.get("forward_costs")
    if costs:
        target = ", ".join(f"{n} token{'s' if int(n) > 1 else ''} {ms:.2f} ms" for n, ms in costs["target_ms"].items())
        line = f"Bare forward passes after the first prompt (median): target {target}"
        if costs.get("draft_ms"):
            line += f"; draft 1 token {next(iter(costs['draft_ms'].values())):.2f} ms"
        parts += ["", line + "."]
    peer = results.get("openvino")
    if peer:
        props = peer["properties"]
        models = [f"{name} {peer[name]['source']} (IR {peer[name]['hash']}, float32 weights)"
                  for name in ("target", "draft") if peer.get(name)]
        parts += ["", f"ov-* methods: OpenVINO GenAI {peer['openvino_genai']} on the CPU, "
                  f"INFERENCE_PRECISION_HINT={props['INFERENCE_PRECISION_HINT']}, "
                  f"KV_CACHE_PRECISION={props['KV_CACHE_PRECISION']}, "
                  f"INFERENCE_NUM_THREADS={props['INFERENCE_NUM_THREADS']}, prefix caching off; "
                  + "; ".join(models) + "."]
    vllm = results.get("vllm")
    if vllm:
        starts = ", ".join(f"{name} {e['start_s']:.0f} s" for name, e in vllm["engines"].items())
        drafter = {"draft": "the draft model", "eagle": "the EAGLE head", "eagle3": "the EAGLE-3 head"}.get(
            vllm["drafter"], "none")
        parts += ["", f"vllm-* methods: {vllm['vllm']} (its own environment), {vllm['dtype']}, eager, prefix "
                  f"caching off, one request at a time; speculative drafter: {drafter}. Engine start-up, not in "
                  f"any timing: {starts}."]
    heur = results.get("hf_assisted_heuristic_settings")
    if heur:
        parts += ["", "hf-assisted-heuristic ran with HF's own assistant settings: "
                  + ", ".join(f"{k}={v}" for k, v in heur.items())]
    slow = [f"{s['label']} ({', '.join(s['slow_runs'])})" for s in results["configs"] if s.get("slow_runs")]
    if slow:
        parts += ["", f"Stalled runs (over {SLOW_RUN_FACTOR:g}x the fastest run of the same method and prompt; "
                  f"a busy machine): {'; '.join(slow)}. Medians are robust to them; totals in results.json are not."]
    broken = [s["label"] for s in results["configs"] if s.get("identical_to_plain") is False]
    if broken and machine.get("gpu"):
        parts += ["", f"**Output differs from plain decoding on the same path for: {', '.join(broken)}** (greedy; "
                  "a GPU's kernels pick their reduction order by a pass's shape, so a verification pass of γ + 1 "
                  "tokens can round otherwise than plain decoding's one-token pass, and greedy paths part at "
                  "near-ties: identity is promised on the CPU paths, and in float64 on a GPU (docs/gpu.md))"]
    elif broken:
        parts += ["", f"**Output differs from plain decoding on the same path for: {', '.join(broken)}** (greedy; "
                  "a bug: see results.json)"]
    notes = [s["label"] for s in results["configs"] if s["identical_to_hf_plain"] is False]
    if notes:
        low = results["models"]["target"]["dtype"] not in ("torch.float32", "torch.float64")
        why = (" (in low precision other kernels round differently, so greedy paths part at near-ties; the "
               "promise is identity with plain decoding on the same path, the last column)") if low else ""
        parts += ["", f"**Output differs from hf-plain for: {', '.join(notes)}**{why} (greedy; see results.json)"]
    return "\n".join(parts)


# --------------------------------------------------------------------------------------------- plots


#: Colours, markers and line styles of the methods in a run's plots. Consecutive methods differ in all three,
#: so lines with identical numbers (specdec and HF with the same draft model accept exactly the same tokens)
#: stay visible on top of each other: a dashed line over a solid one, one marker inside another.
COLORS = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f", "#bcbd22",
          "#17becf")
MARKERS = ("o", "s", "^", "D", "v", "P", "X", "*", "<", ">")
LINESTYLES = ("-", "--", "-.", (0, (5, 2, 1, 2, 1, 2)))  # never ":", which marks predictions and α^i
#: Acceptance-by-position points resting on fewer drafts than this are not drawn.
MIN_POSITION_SAMPLES = 20


def method_styles(results: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """One style per method for every plot of a run (matplotlib keywords: color, marker, markersize,
    linestyle), by the method's place in `specdec bench --list-methods` among the run's methods, so a method
    keeps its colour in every plot whichever methods a plot leaves out."""
    from specdec.bench.runner import available_methods

    order = {name: i for i, name in enumerate(available_methods())}
    theory = results.get("theory", {}).get("configs", [])
    seen = list(dict.fromkeys([*(s["method"] for s in results["configs"]), *(r["method"] for r in theory)]))
    ranked = sorted(seen, key=lambda m: (order.get(m, len(order)), seen.index(m)))
    return {method: {"color": COLORS[i % len(COLORS)], "marker": MARKERS[i % len(MARKERS)],
                     "markersize": 8 - 2 * (i % 3), "linestyle": LINESTYLES[i % len(LINESTYLES)]}
            for i, method in enumerate(ranked)}


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_speedup(results: dict[str, Any], path: Path) -> None:
    plt = _plt()
    configs = results["configs"]
    key, ref = ("speedup_vs_hf_plain", "hf-plain") if any(s.get("speedup_vs_hf_plain") for s in configs) \
        else ("speedup_vs_plain", "plain")
    fig, ax = plt.subplots(figsize=(7, 4.5))
    gammas = sorted({s["gamma"] for s in configs if s["gamma"]}) or [1]
    styles = method_styles(results)
    for method, style in styles.items():
        rows = [s for s in configs if s["method"] == method and s.get(key)]
        if not rows:
            continue
        if rows[0]["gamma"] is None:
            ax.axhline(rows[0][key], linewidth=1.2, color=style["color"], linestyle=style["linestyle"],
                       label=f"{method} (no fixed γ)")
        else:
            rows.sort(key=lambda s: s["gamma"])
            ax.plot([s["gamma"] for s in rows], [s[key] for s in rows], label=method, **style)
    ax.axhline(1.0, color="grey", linewidth=0.8)
    ax.set_xticks(gammas)
    ax.set_xlabel("γ (draft tokens per round)")
    ax.set_ylabel(f"speedup vs {ref} (median tokens/s)")
    ax.set_title("Speedup vs γ")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_tau(results: dict[str, Any], path: Path) -> None:
    plt = _plt()
    rows = results["theory"]["configs"]
    fig, ax = plt.subplots(figsize=(7, 4.5))
    styles = method_styles(results)
    for method in dict.fromkeys(r["method"] for r in rows):
        style = styles[method]
        mine = sorted((r for r in rows if r["method"] == method), key=lambda r: r["gamma"])
        ax.plot([r["gamma"] for r in mine], [r["tau_measured"] for r in mine], label=f"{method} measured", **style)
        ax.plot([r["gamma"] for r in mine], [r["tau_predicted"] for r in mine], linestyle=":", marker="x",
                color=style["color"], label=f"{method} predicted")
    if not rows:
        ax.text(0.5, 0.5, "no fixed-γ drafting method was run", ha="center", va="center", transform=ax.transAxes)
    ax.xaxis.get_major_locator().set_params(integer=True)
    ax.set_xlabel("γ (draft tokens per round)")
    ax.set_ylabel("τ: new tokens per target forward")
    ax.set_title("τ measured vs predicted (1−α^(γ+1))/(1−α), dotted")
    ax.grid(alpha=0.3)
    if rows:
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def acceptance_note(results: dict[str, Any]) -> str | None:
    """Why the acceptance-by-position plot is empty although drafting ran (None when it is not)."""
    drafted = [s for s in results["configs"] if s["acceptance_by_position"]]
    if not drafted:
        return None
    most = max(max(s.get("drafted_at") or [MIN_POSITION_SAMPLES]) for s in drafted)
    if most >= MIN_POSITION_SAMPLES:
        return None
    return (f"too few drafts to plot: every draft position was tested at most {most} times "
            f"(< {MIN_POSITION_SAMPLES});\nraise --num-prompts, --repeats or --max-new-tokens")


def plot_acceptance(results: dict[str, Any], path: Path) -> None:
    """P(draft position i accepted) per method, at the largest γ run (or the method's own γ); positions
    drafted fewer than MIN_POSITION_SAMPLES times are left out."""
    plt = _plt()
    fig, ax = plt.subplots(figsize=(7, 4.5))
    drawn = False
    for method, style in method_styles(results).items():
        rows = [s for s in results["configs"] if s["method"] == method and s["acceptance_by_position"]]
        if not rows:
            continue
        s = max(rows, key=lambda r: (r["gamma"] or 0, len(r["acceptance_by_position"])))
        counts = s.get("drafted_at") or [MIN_POSITION_SAMPLES] * len(s["acceptance_by_position"])
        values = [v for v, n in zip(s["acceptance_by_position"], counts) if n >= MIN_POSITION_SAMPLES]
        if not values:
            continue
        label = f"{method} (γ={s['gamma']})" if s["gamma"] else method
        ax.plot(range(1, len(values) + 1), values, label=label, **style)
        if s.get("alpha_token") and s["gamma"]:
            a = s["alpha_token"]
            ax.plot(range(1, len(values) + 1), [a ** (i + 1) for i in range(len(values))], linestyle=":",
                    color=style["color"], linewidth=1)
        drawn = True
    if not drawn:
        ax.text(0.5, 0.5, acceptance_note(results) or "no drafting method was run", ha="center", va="center",
                transform=ax.transAxes, wrap=True)
    else:
        ax.legend(fontsize=8)
    ax.set_ylim(0, 1.02)
    ax.xaxis.get_major_locator().set_params(integer=True)
    ax.set_xlabel("draft position")
    ax.set_ylabel("fraction of drafts accepted")
    ax.set_title("Acceptance by draft position (dotted: α^i, i.i.d. model)")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def write_plots(results: dict[str, Any], out: Path) -> dict[str, str]:
    out.mkdir(parents=True, exist_ok=True)
    plot_speedup(results, out / PLOTS["speedup"])
    plot_tau(results, out / PLOTS["tau"])
    plot_acceptance(results, out / PLOTS["acceptance"])
    return {name: str(out / file) for name, file in PLOTS.items()}


def write_results(results: dict[str, Any], out: Path) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    path = out / "results.json"
    path.write_text(json.dumps(results, indent=1, default=_json_default) + "\n")
    return path


def _json_default(value: Any) -> Any:
    if isinstance(value, Path):
        return str(value)
    if hasattr(value, "tolist"):
        return value.tolist()
    return str(value)
