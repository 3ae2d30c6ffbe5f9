"""`specdec bench`: specdec's drafters side by side with plain decoding and Hugging Face generation.

    results = specdec.bench.run(target, draft, prompts, BenchSettings(methods=["hf-plain", "draft"]), out="bench")

Modules: `workloads` (prompts), `runner` (interleaved timed runs, HF hooks), `theory` (Leviathan's
predictions from measured α and c), `report` (markdown, results.json, plots), `openvino_peer` and
`openvino_export` (OpenVINO GenAI as a peer: `ov-plain`, `ov-speculative`; docs/openvino.md),
`openvino_exactness` (its sampling through the chi-square test), `vllm_env`, `vllm_peer` and `vllm_worker` (vLLM's
CPU build as a peer: `vllm-plain`, `vllm-speculative`, in an environment of its own; docs/vllm.md).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from specdec.bench.openvino_peer import OV_METHODS, OpenVINOMissing, OpenVINOSettings
from specdec.bench.vllm_peer import VLLM_METHODS, VLLMSettings
from specdec.bench.runner import BenchSettings, available_methods, parse_gammas, parse_methods
from specdec.bench.workloads import BUILTIN_WORKLOADS, BenchPrompt, load_workload


def run(target, draft, prompts: list[BenchPrompt], settings: BenchSettings, *, out: str | Path | None = None,
        workload: str | None = None, progress: bool = True, command: str | None = None,
        pad_token_id: int | None = None, tokenizers: tuple | None = None) -> dict[str, Any]:
    """Benchmark `settings.methods` on `prompts`; with `out`, write results.json and the plots there.

    Returns the results: settings, machine, per-config summaries, theory, every raw run and the outputs.
    """
    from specdec.bench.report import command_line, machine_info, write_plots, write_results
    from specdec.bench.runner import run_benchmark
    from specdec.bench.theory import compare

    raw = run_benchmark(target, draft, prompts, settings, pad_token_id=pad_token_id, progress=progress,
                        tokenizers=tokenizers)
    results: dict[str, Any] = {
        "command": command if command is not None else command_line(),
        "machine": machine_info(settings.device),
        "workload": workload,
        "settings": raw["settings"],
        "models": {"target": _describe(target), "draft": _describe(draft) if draft is not None else None},
        "configs": raw["configs"],
        "theory": compare(raw["configs"], max_gamma=max(16, *settings.gammas)),
        "hf_assisted_heuristic_settings": raw["hf_assisted_heuristic_settings"],
        "openvino": raw["openvino"],
        "vllm": raw["vllm"],
        "forward_costs": raw["forward_costs"],
        "prompts": [p.as_dict() for p in prompts],
        "runs": raw["runs"],
        "outputs": raw["outputs"],
    }
    if out is not None:
        out = Path(out)
        results["plots"] = write_plots(results, out)
        results["results_json"] = str(write_results(results, out))
    return results


def resummarize(results: dict[str, Any], out: str | Path | None = None,
                command: str | None = None) -> dict[str, Any]:
    """Recompute summaries, theory and plots from the raw runs of a saved `results.json` (e.g. after a
    change in how they are summarized); the runs, outputs and the original command are kept."""
    from specdec.bench.report import command_line, write_plots, write_results
    from specdec.bench.runner import Config, add_speedups, summarize
    from specdec.bench.theory import compare

    runs = results["runs"]
    for run in runs:  # files written before these fields existed
        run.setdefault("target_all_s", run["target_prefill_s"] + run["target_s"])
    configs = [Config(c["method"], c["gamma"]) for c in results["configs"]]
    summaries = [summarize(c, [r for r in runs if r["label"] == c.label]) for c in configs]
    add_speedups(summaries)
    results = dict(results, configs=summaries,
                   theory=compare(summaries, max_gamma=max([16] + [c.gamma or 0 for c in configs])),
                   resummarized_by=command if command is not None else command_line())
    if out is not None:
        out = Path(out)
        results["plots"] = write_plots(results, out)
        results["results_json"] = str(write_results(results, out))
    return results


def _describe(model) -> dict[str, Any]:
    params = sum(p.numel() for p in model.parameters())
    config = model.config.get_text_config()
    return {
        "class": type(model).__name__, "parameters": params,
        "layers": getattr(config, "num_hidden_layers", None), "hidden": getattr(config, "hidden_size", None),
        "vocab": getattr(config, "vocab_size", None), "dtype": str(next(model.parameters()).dtype),
        "path": getattr(config, "_name_or_path", "") or None,
    }


__all__ = ["BUILTIN_WORKLOADS", "OV_METHODS", "VLLM_METHODS", "BenchPrompt", "BenchSettings", "OpenVINOMissing",
           "OpenVINOSettings", "VLLMSettings", "available_methods", "load_workload", "parse_gammas", "parse_methods", "resummarize", "run"]
