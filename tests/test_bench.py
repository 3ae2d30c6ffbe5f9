"""`specdec bench`: the runner, the HF hook accounting, theory, workloads, report files and the CLI.

Tiny random float32 models built here; a byte-level BPE trained in a blink on a few lines of code.
"""

from __future__ import annotations

import difflib
import json

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from specdec.bench import BenchSettings, parse_gammas, parse_methods
from specdec.bench import run as run_bench
from specdec.bench.runner import Config, HFCounter, make_configs, summarize
from specdec.bench.theory import compare, predict, recommended_gamma
from specdec.bench.workloads import (
    AGENT_TURNS,
    BenchPrompt,
    agent_prompts,
    code_prompts,
    edit_prompts,
    read_prompt_file,
    rename_identifier,
)
from specdec.errors import ConfigError

CODE = ("def add(a, b):\n    total = a + b\n    return total\n\n\n"
        "class Box:\n    def __init__(self, x):\n        self.x = x\n")


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    from specdec.training.tokenizer import train_tokenizer

    out = tmp_path_factory.mktemp("tok")
    return train_tokenizer([CODE * 10], vocab_size=300, out_dir=out)


class ByteTokenizer:
    """Duck-typed tokenizer: one token per byte."""

    def encode(self, text, add_special_tokens=False):
        return list(text.encode("utf-8"))

    def decode(self, ids, skip_special_tokens=False):
        return bytes(ids).decode("utf-8", errors="replace")


def tiny(vocab: int, layers: int, seed: int) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=layers,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                         initializer_range=0.5, bos_token_id=None, eos_token_id=None, pad_token_id=0)
    model = LlamaForCausalLM(config).to(torch.float32).eval()
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model


# --------------------------------------------------------------------------------------------- theory


def test_theory_matches_hand_computed_numbers():
    # α = 0.8, γ = 4, c = 0.1: τ = (1 - 0.8^5) / 0.2 = 3.3616; speedup = 3.3616 / 1.4.
    p = predict(0.8, 4, 0.1)
    assert p["tau"] == pytest.approx(3.3616)
    assert p["speedup"] == pytest.approx(3.3616 / 1.4)
    # τ/(γc+1) for γ = 5, 6, 7: 2.4595, 2.4696, 2.4477 → 6 is the best γ.
    assert recommended_gamma(0.8, 0.1) == 6
    assert recommended_gamma(0.1, 0.5) == 0  # speculation cannot pay
    assert predict(1.0, 3, None) == {"alpha": 1.0, "gamma": 3, "cost_ratio": None, "tau": 4.0, "speedup": None}


def _summary(method, gamma, **values):
    base = dict(label=f"{method}@{gamma}" if gamma else method, method=method, gamma=gamma, tokens_per_s=10.0,
                tau=1.0, alpha=None, alpha_token=None, cost_ratio=None, accepted=0, rejections=0, drafted=0,
                draft_s=0.0, target_s=1.0, timed_forwards=10, target_s_per_forward=0.1, mean_drafted_per_round=0.0)
    base.update(values)
    return base


def test_theory_compare_uses_per_token_alpha_and_measured_c():
    summaries = [
        _summary("plain", None),
        _summary("draft", 2, tokens_per_s=20.0, tau=2.0, alpha=0.7, alpha_token=0.8, cost_ratio=0.1, accepted=8,
                 rejections=2, drafted=12, draft_s=0.12, target_s=1.0, timed_forwards=10),
        _summary("draft", 4, tokens_per_s=15.0, tau=2.5, alpha=0.6, alpha_token=0.8, cost_ratio=0.1, accepted=16,
                 rejections=4, drafted=28, draft_s=0.28, target_s=1.0, timed_forwards=10),
    ]
    theory = compare(summaries)
    assert theory["baseline"] == "plain"
    row = theory["configs"][0]
    assert row["tau_predicted"] == pytest.approx((1 - 0.8**3) / 0.2)
    assert row["speedup_predicted"] == pytest.approx(((1 - 0.8**3) / 0.2) / 1.2)
    assert row["speedup_measured"] == pytest.approx(2.0)
    method = theory["methods"]["draft"]
    assert method["alpha_token"] == pytest.approx(24 / 30)
    assert method["cost_ratio"] == pytest.approx((0.40 / 40) / (2.0 / 20))
    assert method["gamma_recommended"] == 6 and method["gamma_best_measured"] == 2


def test_theory_compares_a_compiled_method_with_compiled_plain_in_one_pass_units():
    # plain eager 0.1 s a pass, plain compiled 0.05 s; draft-compiled's γ+1 = 3-token pass 0.075 s, and it
    # drafts at c = 0.2 of that pass: v = 1.5 against the compiled one-token pass (not 0.75 against eager).
    summaries = [
        _summary("plain", None),
        _summary("plain-compiled", None, tokens_per_s=20.0, target_s_per_forward=0.05),
        _summary("draft-compiled", 2, tokens_per_s=30.0, tau=2.0, alpha_token=0.8, cost_ratio=0.2,
                 target_s_per_forward=0.075),
        _summary("draft", 2, tokens_per_s=15.0, tau=2.0, alpha_token=0.8, cost_ratio=0.2, target_s_per_forward=0.15),
    ]
    compiled, eager = compare(summaries)["configs"]
    assert compiled["baseline"] == "plain-compiled" and eager["baseline"] == "plain"
    assert compiled["verify_cost_ratio"] == pytest.approx(1.5) and eager["verify_cost_ratio"] == pytest.approx(1.5)
    assert compiled["speedup_measured"] == pytest.approx(1.5) and eager["speedup_measured"] == pytest.approx(1.5)
    assert compiled["cost_ratio_per_plain_pass"] == pytest.approx(0.3)
    tau = (1 - 0.8**3) / 0.2
    assert compiled["speedup_predicted_with_verify_cost"] == pytest.approx(tau / (1.5 * (2 * 0.2 + 1)))


# --------------------------------------------------------------------------------------------- parsing


def test_parse_gammas_and_methods():
    assert parse_gammas("4") == [4]
    assert parse_gammas("1,2,4") == [1, 2, 4]
    assert parse_gammas("1..4,8") == [1, 2, 3, 4, 8]
    for bad in ("0", "auto", "3..1", "x"):
        with pytest.raises(ConfigError):
            parse_gammas(bad)
    assert parse_methods("hf-plain, draft,hf-plain") == ["hf-plain", "draft"]
    assert "hf-assisted" in parse_methods("all")
    with pytest.raises(ConfigError, match="unknown method"):
        parse_methods("nope")
    labels = [c.label for c in make_configs(["plain", "draft", "hf-assisted"], [1, 3])]
    assert labels == ["plain", "draft@1", "draft@3", "hf-assisted@1", "hf-assisted@3"]


def test_cpu_kernel_methods_are_refused_on_a_gpu_before_anything_runs(tmp_path):
    """SelfDraft's int8 / int4 copy runs on the CPU kernels: on a GPU target the bench refuses it up front with
    one error naming the fix, instead of failing at its first prompt after the other methods' runs (a meta-device
    target stands in for a GPU's: the check reads only the target's device)."""
    target = tiny(64, 2, seed=0).to("meta")
    prompts = [BenchPrompt(name="p0", ids=[5, 9, 11], text="")]
    settings = BenchSettings(methods=["plain", "self-draft-int4", "self-draft-int8-compiled"], gammas=[2],
                             max_new_tokens=4, repeats=1, warmup=0, seed=0, forward_costs=False)
    with pytest.raises(ConfigError, match=r"self-draft-int4, self-draft-int8-compiled run on specdec's CPU kernels "
                                          r"only .* drop them from --methods on meta, or run the bench with --device cpu"):
        run_bench(target, None, prompts, settings, out=tmp_path / "out", progress=False, command="test")
    assert not (tmp_path / "out").exists()  # nothing half-written


# --------------------------------------------------------------------------------------------- HF hooks


def test_hf_counter_rebuilds_rounds_from_calls():
    counter = HFCounter(target=None)
    # prompt of 10; round 0 feeds prompt + 3 drafts, keeps 2; round 1 feeds 1 + 3 drafts, keeps all 3;
    # round 2 drafts nothing (plain step); the sequence ends at 18 tokens.
    counter.calls = [[13, 0, 0.5], [4, 12, 0.1], [1, 16, 0.1]]
    s = counter.stats(prompt_len=10, final_len=18)
    assert (s.rounds, s.drafted, s.accepted, s.recovered, s.bonus) == (3, 6, 5, 1, 1)
    assert s.drafted_at == [2, 2, 2] and s.accepted_at == [2, 2, 1]
    assert s.new_tokens == 8 and s.target_forwards == 3
    assert s.prefill_s == 0.5 and s.target_s == pytest.approx(0.2)


# --------------------------------------------------------------------------------------------- workloads


def test_workloads_are_deterministic_and_edit_prompts_hold_the_answer():
    tok = ByteTokenizer()
    first, again = edit_prompts(tok, 3, seed=0), edit_prompts(tok, 3, seed=0)
    assert [p.ids for p in first] == [p.ids for p in again]
    for p in first:
        old, new = p.meta["renamed"]
        assert f"renamed to `{new}`" in p.text
        assert p.text.endswith("\n") and new in p.text.splitlines()[-1]  # the renamed def line
        body = p.expected
        assert body.strip() and new in body
        # Undoing the rename, every line of the expected answer is in the prompt...
        for line in body.replace(new, old).splitlines():
            assert line in p.text
        # ...so the answer is mostly a copy of the prompt.
        assert difflib.SequenceMatcher(None, body, p.text).find_longest_match().size > 0.3 * len(body)
    code = code_prompts(tok, 2, prompt_tokens=40, seed=3)
    assert [p.ids for p in code] == [p.ids for p in code_prompts(tok, 2, prompt_tokens=40, seed=3)]
    assert all(len(p.ids) == 40 for p in code)


def test_agent_sessions_repeat_one_task_with_a_growing_log():
    """`agent`: AGENT_TURNS requests per session, in order; each repeats the one before with one more log line (an
    agent's retries), every request starts with the same preamble and ends in the renamed def line."""
    tok = ByteTokenizer()
    prompts = agent_prompts(tok, 2 * AGENT_TURNS, seed=0, max_prompt_tokens=4000)
    assert [p.ids for p in prompts] == [p.ids for p in agent_prompts(tok, 2 * AGENT_TURNS, seed=0,
                                                                       max_prompt_tokens=4000)]
    sessions = [prompts[:AGENT_TURNS], prompts[AGENT_TURNS:]]
    assert sessions[0][0].source.split(":")[0] != sessions[1][0].source.split(":")[0]  # one file per session
    for session in sessions:
        assert [p.meta["turn"] for p in session] == list(range(1, AGENT_TURNS + 1))
        first = session[0].text
        for turn, p in enumerate(session):
            assert p.text.startswith(first.split("# Task:")[0]) and p.text.count("# attempt ") == turn
            old, new = p.meta["renamed"]
            assert p.text.splitlines()[-1].startswith("def ") and new in p.text.splitlines()[-1]
            assert not p.text.endswith("\n")  # the tokenizer joins the def line's newline with the indent
            assert p.expected.strip() and new in p.expected
            if turn:  # the request before it, plus one log line
                lines = p.text.split("\n")
                assert "\n".join(x for x in lines if not x.startswith(f"# attempt {turn}:")) == session[turn - 1].text
    with pytest.raises(ConfigError, match="--num-prompts"):
        agent_prompts(tok, 4, seed=0, max_prompt_tokens=10)


def test_rename_identifier_leaves_attributes_and_keywords():
    src = "def f(x, y=1):\n    z = obj.x + x\n    return g(x=x, y=y)\n"
    assert rename_identifier(src, "x", "new_x") == \
        "def f(new_x, y=1):\n    z = obj.x + new_x\n    return g(x=new_x, y=y)\n"


def test_prompt_files(tmp_path):
    lines = tmp_path / "p.txt"
    lines.write_text("first prompt\n\nsecond prompt\n")
    assert read_prompt_file(lines) == ["first prompt", "second prompt"]
    jsonl = tmp_path / "p.jsonl"
    jsonl.write_text('{"prompt": "def f():\\n    return 1"}\n{"prompt": "x"}\n')
    assert read_prompt_file(jsonl) == ["def f():\n    return 1", "x"]
    jsonl.write_text('{"text": "x"}\n')
    with pytest.raises(ConfigError, match='"prompt"'):
        read_prompt_file(jsonl)


# --------------------------------------------------------------------------------------------- runs


def test_bench_run_library_greedy_identity_and_files(tmp_path):
    target, draft = tiny(64, 2, seed=0), tiny(64, 1, seed=1)
    prompts = [BenchPrompt(name="p0", ids=[5, 9, 11, 3, 7, 9, 11, 3], text="")]
    settings = BenchSettings(methods=["hf-plain", "plain", "draft", "hf-assisted"], gammas=[2], max_new_tokens=10,
                             repeats=2, warmup=0, seed=0, forward_costs=False)
    results = run_bench(target, draft, prompts, settings, out=tmp_path, progress=False, command="test")
    by_label = {s["label"]: s for s in results["configs"]}
    assert set(by_label) == {"hf-plain", "plain", "draft@2", "hf-assisted@2"}
    for s in by_label.values():
        assert s["identical_to_hf_plain"] is True, s["label"]
        assert s["new_tokens"] == 2 * 10 and s["runs"] == 2
    assert by_label["plain"]["tau"] == 1.0 and by_label["hf-plain"]["tau"] == 1.0
    assert by_label["draft@2"]["drafted"] > 0 and by_label["draft@2"]["cost_ratio"] > 0
    # Same draft, same target, same greedy rule: HF's rounds (rebuilt from hooks) match specdec's.
    assert by_label["hf-assisted@2"]["accepted"] == by_label["draft@2"]["accepted"]
    assert by_label["hf-assisted@2"]["target_forwards"] == by_label["draft@2"]["target_forwards"]
    assert len(results["runs"]) == 4 * 2
    # The repeats of one prompt are interleaved: the order rotates between rounds.
    order = [r["label"] for r in results["runs"]]
    assert order[:4] != order[4:]
    saved = json.loads((tmp_path / "results.json").read_text())
    assert saved["command"] == "test" and saved["settings"]["gammas"] == [2]


def test_bench_cli_end_to_end(tmp_path, tokenizer, capsys):
    from specdec.cli import main

    vocab = len(tokenizer)
    target = tiny(vocab, 2, seed=0)
    target.save_pretrained(tmp_path / "target")
    tokenizer.save_pretrained(tmp_path / "target")
    target.save_pretrained(tmp_path / "draft")  # draft = target: every draft must be accepted
    prompt_file = tmp_path / "prompts.jsonl"
    prompt_file.write_text(json.dumps({"prompt": CODE}) + "\n")
    out = tmp_path / "out"
    code = main(["bench", "--target", str(tmp_path / "target"), "--draft", str(tmp_path / "draft"),
                 "--methods", "hf-plain,draft,hf-assisted", "--gamma", "2", "--prompts", str(prompt_file),
                 "--num-prompts", "1", "--max-new-tokens", "8", "--repeats", "1", "--warmup", "0",
                 "--out", str(out), "--no-progress"])
    assert code == 0
    stdout = capsys.readouterr().out
    assert "| method |" in stdout and "hf-assisted" in stdout
    results = json.loads((out / "results.json").read_text())
    for key in ("command", "machine", "settings", "configs", "theory", "prompts", "runs", "outputs", "models"):
        assert key in results
    assert results["machine"]["torch"] == torch.__version__ and results["machine"]["cpu"]
    assert results["command"].startswith("specdec bench") or "bench" in results["command"]
    by_label = {s["label"]: s for s in results["configs"]}
    for label in ("draft@2", "hf-assisted@2"):
        s = by_label[label]
        assert s["identical_to_hf_plain"] is True
        assert s["alpha_token"] == 1.0 and s["alpha"] == 1.0
        assert s["tau"] == pytest.approx(8 / 3)  # rounds of 3, 3, then 2 tokens
        assert s["acceptance_by_position"] == [1.0, 1.0]
    costs = results["forward_costs"]
    assert set(costs["target_ms"]) == {"1", "3"} and costs["draft_ms"]["1"] > 0  # JSON keys are strings
    theory = results["theory"]["configs"][0]
    assert theory["tau_predicted"] == pytest.approx(3.0)
    for name in ("speedup_vs_gamma.png", "tau_measured_vs_predicted.png", "acceptance_by_position.png"):
        data = (out / name).read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 5000
    raw = results["runs"][0]
    for key in ("wall_s", "tokens_per_s", "target_forwards", "drafted_at", "accepted_at", "target_s", "draft_s"):
        assert key in raw


def test_bench_sampling_runs_and_reports_no_identity(tmp_path):
    target, draft = tiny(64, 2, seed=0), tiny(64, 1, seed=1)
    prompts = [BenchPrompt(name="p0", ids=[5, 9, 11, 3], text="")]
    settings = BenchSettings(methods=["hf-plain", "draft", "hf-assisted"], gammas=[3], max_new_tokens=6, repeats=1,
                             warmup=0, temperature=0.9, top_k=20, forward_costs=False)
    results = run_bench(target, draft, prompts, settings, progress=False, command="test")
    for s in results["configs"]:
        assert s["identical_to_hf_plain"] is None and s["new_tokens"] == 6


def test_summarize_pools_counts():
    runs = [dict(label="draft@2", prompt="p0", repeat=i, tokens_per_s=t, wall_s=w, new_tokens=10, target_forwards=5, timed_forwards=5,
                 draft_forwards=0, rounds=5, drafted=10, accepted=a, rejections=r, drafted_at=[5, 5],
                 accepted_at=[a - a // 2, a // 2], target_s=0.5, draft_s=0.1, target_prefill_s=0.1, target_all_s=0.6,
                 other_s=w - 0.7, identical_to_hf_plain=True, identical_to_plain=None)
            for i, (t, a, r, w) in enumerate(((10.0, 6, 3, 1.0), (30.0, 4, 4, 1.0), (1.0, 5, 5, 9.0)))]
    s = summarize(Config("draft", 2), runs)
    assert s["tokens_per_s"] == 10.0 and s["tau"] == 2.0  # median of 10, 30, 1
    assert s["alpha"] == pytest.approx(15 / 30) and s["alpha_token"] == pytest.approx(15 / 27)
    assert s["cost_ratio"] == pytest.approx((0.1 / 10) / (0.5 / 5))
    assert s["target_share"] == pytest.approx(0.6) and s["other_share"] == pytest.approx(0.3)
    assert s["slow_runs"] == ["p0#2"]  # 9 s against a fastest 1 s: stalled
    assert s["identical_to_hf_plain"] is True and s["identical_to_plain"] is None


def test_report_tells_a_low_precision_difference_from_a_bug(tmp_path):
    """A method that differs from plain decoding on its own path is flagged as a bug; one that differs only
    from hf-plain in bfloat16 is explained, not flagged."""
    from specdec.bench.report import markdown

    target, draft = tiny(64, 2, seed=0), tiny(64, 1, seed=1)
    prompts = [BenchPrompt(name="p0", ids=[5, 9, 11, 3, 7, 9, 11, 3], text="")]
    settings = BenchSettings(methods=["hf-plain", "plain", "draft"], gammas=[2], max_new_tokens=6, repeats=1,
                             warmup=0, seed=0, forward_costs=False)
    results = run_bench(target, draft, prompts, settings, out=tmp_path, progress=False, command="test")
    by_label = {s["label"]: s for s in results["configs"]}
    assert by_label["draft@2"]["identical_to_plain"] is True
    assert "differs" not in markdown(results)
    by_label["draft@2"]["identical_to_hf_plain"] = False
    results["models"]["target"]["dtype"] = "torch.bfloat16"
    text = markdown(results)
    assert "differs from hf-plain for: draft@2** (in low precision" in text and "a bug" not in text
    by_label["draft@2"]["identical_to_plain"] = False
    assert "differs from plain decoding on the same path for: draft@2** (greedy; a bug" in markdown(results)
    results["machine"].update(device="cuda", gpu="NVIDIA H200")  # a GPU's kernels are not row-invariant: explained
    text = markdown(results)
    assert "on NVIDIA H200 (cuda, host " in text
    assert "draft@2** (greedy; a GPU's kernels pick their reduction order" in text and "a bug" not in text


def test_results_name_the_cpu_generation_and_the_kernel_tier_that_ran():
    """A figure holds for its CPU class: results.json and the report's first line say which (the family where the
    model name does not, e.g. "AMD EPYC") and which kernel tier ran; older results without them still render."""
    from specdec.bench.report import _cpu_detail, machine_info
    from specdec.runtime.precision import cpu_family_model
    from specdec.runtime.rowwise import cpu_tiers, kernel_tier

    machine = machine_info()
    assert machine["kernel_tier"] == kernel_tier() and machine["kernel_tier"] in cpu_tiers()
    assert machine["cpu_family_model"] == cpu_family_model()
    detail = _cpu_detail(machine)
    assert f"kernels: {kernel_tier()} tier, " in detail
    if machine["cpu_family_model"] is not None:
        assert detail.startswith("family ")
    assert _cpu_detail({"cpu": "old results"}) == ""


def test_each_method_is_held_to_plain_decoding_on_its_own_path():
    from specdec.bench.runner import plain_on_path

    assert [plain_on_path(m) for m in ("draft", "suffix-compiled", "hf-assisted", "ov-speculative", "vllm-suffix",
                                       "vllm-plain")] == [
        "plain", "plain-compiled", "plain", "ov-plain", "vllm-plain", "vllm-plain"]
