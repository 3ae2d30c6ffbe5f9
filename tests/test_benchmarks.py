"""Every script in benchmarks/ still starts: one smoke test per script, run in this process (runpy), so that a
change of the library cannot silently break the scripts behind the published numbers (benchmarks/README.md).
Each answers `--help` (its argument parser is built and every module it imports is importable); the table scripts
also run on tiny inputs, oracle_speedup.py and load_memory.py on a tiny model, identity_table.py on one short prompt
of the shipped pair (its target on w8a8 weights), and server_identity.py serves the shipped pair to two short
prompts."""

from __future__ import annotations

import json
import runpy
import sys
from pathlib import Path

import pytest

import specdec

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"
SCRIPTS = sorted(p.stem for p in BENCHMARKS.glob("*.py"))


def run_script(name: str, *args: str, monkeypatch) -> None:
    monkeypatch.setattr(sys, "argv", [str(BENCHMARKS / f"{name}.py"), *args])
    runpy.run_path(str(BENCHMARKS / f"{name}.py"), run_name="__main__")


def _multi_draft_runs(tmp_path: Path) -> list[str]:
    rows = []
    for prompt in range(2):
        for cfg, tau, drafted in (("chain:2", 1.8, 2), ("chain:4", 2.4, 4), ("rrs:2:2", 2.2, 3)):
            rows.append(dict(cfg=cfg, wl="code", prompt=prompt, seed=0, tau=tau + prompt / 10, rounds=10,
                             drafted=10 * drafted, accepted=5, wall=1.0, target_s=0.5, draft_s=0.2))
            rows.append({**rows[-1], "wl": "edit"})
    path = tmp_path / "runs.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return [str(path)]


def _tree_fastpath_run(tmp_path: Path) -> list[str]:
    rows = [dict(method=m, prompt=f"code-{p}", rep=0, tok_s=speed + p, load=1.0, drafted_per_round=3.0, tau=2.0,
                 target_ms=10.0, draft_ms=4.0)
            for m, speed in (("plain", 50.0), ("chain-g3", 80.0), ("tree-8", 90.0)) for p in (0, 1)]
    path = tmp_path / "run.json"
    path.write_text(json.dumps({"rows": rows}))
    return [str(path), "code-1"]


def _identity_table_run(tmp_path: Path) -> list[str]:
    """The target on w8a8 weights (`--weights`): the quantized model against its own plain decoding."""
    return ["--dtypes", "bfloat16:1", "--new-tokens", "4", "--methods", "eager draft γ=4", "--weights", "w8a8",
            "--out", str(tmp_path)]


def _op_classes_run(tmp_path: Path) -> list[str]:
    classes = {"linear": 0.004, "LM head": 0.001, "attention": 0.0005, "norm + rope + pointwise": 0.0002,
               "rest": 0.0003, "total": 0.006}
    runs = {f"{side}/float32/{rows}": {"wall": {"median_s": 0.004 * scale * rows, "min_s": 0.003, "n": 4},
                                       "classes": classes}
            for side, scale in (("specdec", 1.0), ("hf", 1.5), ("openvino", 0.5)) for rows in (1, 5)}
    results = {"name": "tiny", "command": "python benchmarks/op_classes.py", "when": "now", "machine": "x86_64",
               "torch": "2", "rows": [1, 5], "dtypes": ["float32"], "prompt_len": 8, "steps": 4, "blocks": 2,
               "profile_steps": 4, "threads": 1, "runs": runs, "load_before": "1 1 1", "load_after": "1 1 1",
               "weight_bytes": {"float32": 8e6, "bfloat16": 4e6},
               "model": {"source": "tiny", "parameters": 2e6, "layers": 2, "hidden": 64, "intermediate": 128,
                         "heads": 4, "kv_heads": 2, "vocab": 100}}
    path = tmp_path / "tiny.json"
    path.write_text(json.dumps(results))
    return ["--table-from", str(path)]


def _oracle_speedup_run(tmp_path: Path) -> list[str]:
    return ["--model", "llama-tiny", "--target-weights", "float32", "--drafts", "int8", "--draft-vocab", "0,48",
            "--alphas", "0,1",
            "--gammas", "3", "--prompts", "1", "--prompt-len", "8", "--new-tokens", "12"]


def _server_identity_run(tmp_path: Path) -> list[str]:
    return ["--prompts", "2", "--new-tokens", "4", "--streams", "2", "--out", str(tmp_path)]


def _load_memory_run(tmp_path: Path) -> list[str]:
    return ["--model", "llama-tiny", "--weights", "int8", "--ways", "whole,self-draft", "--request", "2",
            "--files", "bin", "--dir", str(tmp_path / "checkpoint")]


def _class_row_run(tmp_path: Path) -> list[str]:
    """Two prompts: the draft is 3x / 2x plain, OpenVINO's speculative 2x / 1x its plain (prompt 0 / 1)."""
    speeds = {"hf-plain-f32": (50, 50), "plain-compiled": (100, 100), "draft-compiled@6": (300, 200),
              "ov-plain": (100, 100), "ov-speculative@6": (200, 100)}
    runs = [{"label": label, "prompt": f"code-{p}", "tokens_per_s": tps[p] * (1 + repeat / 100)}
            for label, tps in speeds.items() for p in (0, 1) for repeat in (0, 1, 2)]
    path = tmp_path / "results.json"
    path.write_text(json.dumps({"machine": {"cpu": "tiny"}, "settings": {"methods": list(speeds)}, "runs": runs}))
    return [str(path)]


#: Scripts that also run on tiny inputs: script -> (tmp_path -> arguments, a line the output must contain).
TINY_RUNS = {
    # per-prompt ratios: the draft ÷ OpenVINO's speculative best is 1.5x on prompt 0 and 2x on prompt 1
    "class_row": (_class_row_run, "  ÷ OpenVINO speculative best (ov-speculative@6): 1.75x (1.50–2.00); "
                                  "ov-speculative@6 at 151.5 tokens/s"),
    "identity_table": (_identity_table_run,
                       "| bfloat16, w8a8 weights | eager draft γ=4 | eager plain | 1/1 | 100.0% | 4 |"),
    # α 1: every oracle token accepted, γ+1 tokens a round (and each output is checked against plain decoding); the
    # draft over 48 tokens runs after the whole vocabulary's
    "oracle_speedup": (_oracle_speedup_run, "SelfDraft int8/vocab48 γ 3 α 1.000 (realized 1.000): τ 4.00"),
    # each output at T = 0 is checked against plain decoding; the reduced vocabulary's line comes last
    "self_draft_vocab": (lambda tmp_path: ["--formats", "w4a8", "--vocabs", "0,2048", "--prompts", "1",
                                           "--new-tokens", "8"], "SelfDraft w4a8 vocab 2048 edit T=1: α"),
    "server_identity": (_server_identity_run, "| bfloat16 | eager | 2 | 2/2 | 2/2 | 8 |"),
    # a checkpoint saved, loaded two ways in processes of their own, a request after each (a way that fails fails
    # the script)
    "load_memory": (_load_memory_run, "then a request of 2 tokens in"),
    "multi_draft_summary": (_multi_draft_runs, "edit rrs:2:2        drafted/round  3.00 τ 2.250 chain τ at that many "
                                               "drafts (interp.) 2.150 ratio 1.047"),
    "tree_fastpath_table": (_tree_fastpath_run, "| tree-8 | 3.0 | 2.00 | 90.0 | 1.80x | 1.12x | 10.0 | 4.0 |"),
    "attention_rows": (lambda tmp_path: ["--models", "llama-tiny", "--slots", "40", "--rows", "1,3", "--repeats", "1"],
                       "llama-tiny 4/2 x 16     40 slots   3 rows"),
    "linears_pass": (lambda tmp_path: ["--shape", "llama-tiny", "--formats", "bfloat16,int8", "--rows", "1,2",
                                       "--repeats", "1"], "llama-tiny int8"),
    "op_classes": (_op_classes_run, "| f32 | 5 | specdec, HF kernels | 4.000 | 1.000 | 0.500 | 0.200 | 0.300 | 6.000 "
                                    "| **30.00** | 3.000 | – |"),
}


def test_every_script_has_a_smoke_test():
    assert len(SCRIPTS) >= 20 and set(TINY_RUNS) <= set(SCRIPTS)


def test_every_script_is_in_the_readme_table():
    """benchmarks/README.md says what each script measures and where its figures are."""
    text = (BENCHMARKS / "README.md").read_text()
    assert [name for name in SCRIPTS if f"[{name}.py]({name}.py)" not in text] == []


@pytest.mark.parametrize("name", SCRIPTS)
def test_benchmark_script_starts(name, monkeypatch, capsys, tmp_path):
    with pytest.raises(SystemExit) as exit_info:
        run_script(name, "--help", monkeypatch=monkeypatch)
    assert exit_info.value.code == 0
    assert "usage:" in capsys.readouterr().out
    if name in TINY_RUNS:
        make_args, expected = TINY_RUNS[name]
        try:
            run_script(name, *make_args(tmp_path), monkeypatch=monkeypatch)
        finally:
            specdec.set_threads("auto")  # a script may fix specdec's thread count for the process
        assert expected in capsys.readouterr().out


def test_ladder_models_hold_no_two_parameters_alike():
    """The ladder's random weights start each parameter at its own place in the random block: a runtime that keeps
    one copy of identical constants (OpenVINO's export does) would otherwise run every layer on one layer's weights."""
    sys.path.insert(0, str(BENCHMARKS))
    try:
        from size_ladder import build
    finally:
        sys.path.remove(str(BENCHMARKS))
    import torch

    for shape in ("llama-tiny", "whisper-tiny-random", "olmoe-tiny-random"):  # (an encoder-decoder's two stacks, a
        params = list(build(shape, torch.float32).parameters())  # MoE's stacked experts)
        same_shape = [(a, b) for i, a in enumerate(params) for b in params[i + 1 :] if a.shape == b.shape]
        assert len(same_shape) >= 10  # the layers' weights, norms included
        assert not any(torch.equal(a, b) for a, b in same_shape), shape


def test_a_moe_shape_counts_the_bytes_and_weights_of_a_row_s_own_experts():
    """size_ladder's MoE shape: a row reads the attention, the LM head and its experts_per_token experts of each layer,
    whether the experts are transformers' own or packed (then in the packed bytes)."""
    sys.path.insert(0, str(BENCHMARKS))
    try:
        from size_ladder import MOE, build, linear_params, weight_bytes
    finally:
        sys.path.remove(str(BENCHMARKS))
    import torch

    from specdec.runtime.weights import pack_model

    model = build("olmoe-tiny-random", torch.float32)
    experts, per_token = MOE["olmoe-tiny-random"]
    config = model.config
    dense = sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear))
    expert = 3 * config.hidden_size * config.intermediate_size  # gate, up and down of one expert
    assert linear_params(model, per_token) == dense + config.num_hidden_layers * per_token * expert
    assert weight_bytes(model, per_token) == 4 * (dense + config.num_hidden_layers * per_token * expert)
    packed = pack_model(model, "float32")
    assert linear_params(packed, per_token) == dense + config.num_hidden_layers * per_token * expert
    assert dense * 4 < weight_bytes(packed, per_token) < 4 * (dense + config.num_hidden_layers * experts * expert)
