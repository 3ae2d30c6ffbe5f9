"""The OpenVINO GenAI peer in `specdec bench` (ov-plain, ov-speculative).

The default suite checks what needs no OpenVINO: the refusal without the extra, method parsing, the content
hash and the export cache (driven by a stand-in optimum-cli), the precision mapping and the rebuilt rounds.
The end-to-end tests export the shipped default pair and run it; they are skipped, with the reason, when the
openvino extra is missing, or when neither the export environment nor a cached export of the pair is there
(`make test-openvino` installs both).
"""

from __future__ import annotations

import json
import stat
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from specdec.bench import BenchPrompt, BenchSettings, OpenVINOMissing, OpenVINOSettings, parse_methods
from specdec.bench import run as run_bench
from specdec.bench.openvino_export import (
    EXPORT_MARKER,
    WEIGHT_FORMATS,
    OpenVINOExportError,
    content_hash,
    create_export_env,
    default_cache_dir,
    default_export_env,
    exported,
)
from specdec.bench.openvino_peer import device_properties, require_openvino, require_precision, speculative_stats
from specdec.bench.runner import make_configs
from specdec.hub.default_pair import default_assets_dir
from specdec.errors import ConfigError, SpecdecError

INSTALL_LINE = 'pip install "specdec[openvino]"'


@pytest.fixture
def no_openvino(monkeypatch):
    """As if the openvino extra were not installed: `import openvino_genai` fails."""
    monkeypatch.setitem(sys.modules, "openvino_genai", None)


def tiny_pair():
    from transformers import LlamaConfig, LlamaForCausalLM

    def tiny(layers, seed):
        torch.manual_seed(seed)
        config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=layers,
                             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                             bos_token_id=None, eos_token_id=None, pad_token_id=0)
        return LlamaForCausalLM(config).eval()

    return tiny(2, 0), tiny(1, 1)


# --------------------------------------------------------------------------------------------- without the extra


def test_cli_refuses_ov_methods_without_the_extra_in_one_line(no_openvino, tmp_path, capsys):
    from specdec.cli import main

    code = main(["bench", "--methods", "plain,ov-plain,ov-speculative", "--num-prompts", "1", "--no-progress",
                 "--out", str(tmp_path / "out")])
    err = capsys.readouterr().err.strip()
    assert code == 2
    assert err.splitlines() == [f"specdec: error: ov-plain, ov-speculative need OpenVINO GenAI, which is not "
                                f"installed: {INSTALL_LINE}"]
    assert not (tmp_path / "out").exists()  # refused before anything ran or was written


def test_library_refuses_ov_methods_without_the_extra(no_openvino):
    target, draft = tiny_pair()
    prompts = [BenchPrompt(name="p0", ids=[5, 9, 11, 3], text="")]
    settings = BenchSettings(methods=["plain", "ov-plain"], max_new_tokens=4, repeats=1, warmup=0,
                             forward_costs=False, openvino=OpenVINOSettings(target_dir="unused"))
    with pytest.raises(OpenVINOMissing, match=r"ov-plain needs OpenVINO GenAI.*pip install \"specdec\[openvino\]\""):
        run_bench(target, draft, prompts, settings, progress=False, command="test")
    assert issubclass(OpenVINOMissing, SpecdecError)


def test_other_methods_never_need_openvino(no_openvino):
    require_openvino(["plain", "draft", "hf-plain"])  # nothing asked of OpenVINO: no error
    assert not [m for m in parse_methods("all") if m.startswith("ov-")]  # 'all' leaves the peer out
    target, draft = tiny_pair()
    prompts = [BenchPrompt(name="p0", ids=[5, 9, 11, 3], text="")]
    settings = BenchSettings(methods=parse_methods("plain,draft"), gammas=[2], max_new_tokens=4, repeats=1,
                             warmup=0, forward_costs=False)
    results = run_bench(target, draft, prompts, settings, progress=False, command="test")
    assert results["openvino"] is None and all(s["identical_to_hf_plain"] for s in results["configs"])


def test_setup_on_a_finished_export_environment_says_it_is_ready_and_creates_nothing(tmp_path, capsys):
    from specdec.bench.openvino_export import ENV_MARKER
    from specdec.cli import main

    env = tmp_path / "env"
    env.mkdir()
    (env / ENV_MARKER).write_text("{}")
    assert main(["bench", "--openvino-setup", "--openvino-export-env", str(env)]) == 0
    assert capsys.readouterr().out == f"ready: {env}\n"
    assert sorted(p.name for p in env.iterdir()) == [ENV_MARKER]


def test_ov_methods_parse_like_the_others():
    assert parse_methods("ov-plain,ov-speculative") == ["ov-plain", "ov-speculative"]
    labels = [c.label for c in make_configs(["ov-plain", "ov-speculative"], [2, 4])]
    assert labels == ["ov-plain", "ov-speculative@2", "ov-speculative@4"]


def test_library_needs_the_checkpoint_directories():
    pytest.importorskip("openvino_genai", reason=f"the openvino extra is not installed: {INSTALL_LINE}")
    target, draft = tiny_pair()
    settings = BenchSettings(methods=["ov-plain"], max_new_tokens=4, repeats=1, warmup=0, forward_costs=False)
    with pytest.raises(ConfigError, match="OpenVINOSettings"):
        run_bench(target, draft, [BenchPrompt(name="p0", ids=[5, 9], text="")], settings, progress=False)


# --------------------------------------------------------------------------------------------- precision, rounds


def test_precision_and_threads_follow_the_run():
    assert device_properties(torch.float32, 1) == {"INFERENCE_PRECISION_HINT": "f32", "KV_CACHE_PRECISION": "f32",
                                                   "INFERENCE_NUM_THREADS": 1}
    assert device_properties(torch.bfloat16, 2) == {"INFERENCE_PRECISION_HINT": "bf16", "KV_CACHE_PRECISION": "bf16",
                                                    "INFERENCE_NUM_THREADS": 2}
    for dtype in (torch.float16, torch.float64):
        with pytest.raises(ConfigError, match="--dtype float32 or --dtype bfloat16"):
            device_properties(dtype, 1)


def test_bfloat16_on_one_thread_with_amx_is_refused_by_name(monkeypatch):
    """OpenVINO's bf16 pipeline on one thread dies of SIGFPE on a CPU with AMX: refused before it is built."""
    pytest.importorskip("openvino", reason=f"the openvino extra is not installed: {INSTALL_LINE}")
    import openvino as ov

    if "BF16" not in ov.Core().get_property("CPU", "OPTIMIZATION_CAPABILITIES"):
        with pytest.raises(ConfigError, match="--openvino-dtype float32"):
            require_precision("bf16", 2)
        return
    from specdec.runtime import cpuinfo

    monkeypatch.setattr(cpuinfo, "flags", lambda: {"avx512_bf16", "amx_tile", "amx_bf16"})
    with pytest.raises(ConfigError, match="one thread on a CPU with AMX.*--threads 2"):
        require_precision("bf16", 1)
    require_precision("bf16", 2)
    require_precision("f32", 1)
    monkeypatch.setattr(cpuinfo, "flags", lambda: {"avx512_bf16"})
    require_precision("bf16", 1)


def test_speculative_rounds_are_rebuilt_from_the_target_steps():
    # 12 new tokens at γ = 3: the prefill makes 1, then steps of 4 (3 drafts accepted + the bonus), 1 (none
    # accepted), 3 (2 accepted); 9 done, so the next step drafts only 12 - 9 - 1 = 2 and makes 2 (1 accepted);
    # the last step has 1 token left to make and drafts nothing.
    main = SimpleNamespace(m_batch_sizes=[1, 4, 1, 3, 2, 1], m_durations=[5000.0, 2000.0, 2000.0, 2000.0, 2000.0, 1000.0])
    draft = SimpleNamespace(m_batch_sizes=[2, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1], m_durations=[500.0] + [100.0] * 11)
    metrics = SimpleNamespace(main_model_metrics=SimpleNamespace(raw_metrics=main),
                              draft_model_metrics=SimpleNamespace(raw_metrics=draft),
                              get_num_draft_tokens=lambda: 12, get_num_accepted_tokens=lambda: 6)
    s, prefill, extra = speculative_stats(metrics, gamma=3, max_new_tokens=12)
    assert s.target_forwards == 6 and s.draft_forwards == 12 and s.rounds == 5
    assert s.gammas == [3, 3, 3, 2, 0]
    assert (s.drafted, s.accepted, s.recovered, s.bonus, s.target_only) == (11, 6, 3, 1, 1)
    assert s.drafted_at == [4, 4, 3] and s.accepted_at == [3, 2, 1]
    assert prefill == pytest.approx(5e-3) and s.target_s == pytest.approx(9e-3) and s.draft_s == pytest.approx(1.6e-3)
    assert extra == {"ov_draft_tokens": 12, "ov_accepted_tokens": 6}


def test_exactness_check_says_when_ov_speculative_had_no_power():
    """As `specdec verify`: a speculative run that drafted nothing tested plain decoding only, and says so."""
    from specdec.bench.openvino_exactness import check_openvino_exactness

    target, _ = tiny_pair()

    class Peer:  # a stand-in OpenVINOPeer: one continuation, drafting `drafted` tokens, accepting none
        def __init__(self, drafted: int):
            self.drafted = drafted

        def run(self, method, gamma, prompt, **kwargs):
            return SimpleNamespace(tokens=[1, 2], stats=SimpleNamespace(drafted=self.drafted, accepted=0,
                                                                          target_forwards=2))

    kwargs = dict(temperature=1.0, top_k=2, max_new_tokens=2, samples=20)
    idle = check_openvino_exactness(Peer(0), target, [5, 9, 11], method="ov-speculative", gamma=2, **kwargs)
    assert "proposed no token" in idle.power_warning and idle.power_warning in idle.notes
    rejected = check_openvino_exactness(Peer(4), target, [5, 9, 11], method="ov-speculative", gamma=2, **kwargs)
    assert "accept path never ran" in rejected.power_warning
    plain = check_openvino_exactness(Peer(0), target, [5, 9, 11], method="ov-plain", **kwargs)
    assert plain.power_warning is None  # plain decoding drafts nothing by design


# --------------------------------------------------------------------------------------------- export cache


def fake_export_env(root: Path, *, fail: bool = False) -> Path:
    """An export environment whose optimum-cli writes a stand-in IR and counts its calls."""
    cli = root / "bin" / "optimum-cli"
    cli.parent.mkdir(parents=True)
    body = "sys.stderr.write('conversion failed: unsupported model\\n'); sys.exit(1)" if fail else (
        "out = pathlib.Path(sys.argv[-1]); out.mkdir(parents=True)\n"
        "(out / 'openvino_model.xml').write_text(' '.join(sys.argv[1:]))\n"
        "calls = pathlib.Path(__file__).with_name('calls'); calls.write_text(calls.read_text() + 'x' "
        "if calls.exists() else 'x')")
    cli.write_text(f"#!{sys.executable}\nimport pathlib, sys\n{body}\n")
    cli.chmod(cli.stat().st_mode | stat.S_IXUSR)
    return root


def checkpoint(root: Path, weights: bytes = b"weights") -> Path:
    root.mkdir(parents=True, exist_ok=True)
    (root / "config.json").write_text('{"model_type": "llama"}')
    (root / "model.safetensors").write_bytes(weights)
    (root / "tokenizer.json").write_text("{}")
    return root


def test_content_hash_covers_every_model_file_and_nothing_else(tmp_path):
    model = checkpoint(tmp_path / "m")
    first = content_hash(model)
    assert first == content_hash(model) and len(first) == 16
    (model / "README.md").write_text("docs do not change the model")
    assert content_hash(model) == first
    (model / "model.safetensors").write_bytes(b"weightz")
    assert content_hash(model) != first
    (model / "model.safetensors").write_bytes(b"weights")
    (model / "tokenizer.json").rename(model / "tokenizer2.json")  # same bytes, another name
    assert content_hash(model) != first
    with pytest.raises(OpenVINOExportError, match="no config.json"):
        content_hash(tmp_path)


def test_export_once_then_reuse_by_content_hash(tmp_path):
    env, cache, model = fake_export_env(tmp_path / "env"), tmp_path / "cache", checkpoint(tmp_path / "m")
    first = exported(model, cache, env)
    assert first.exported_now and first.path == cache / f"{content_hash(model)}-fp32"
    ir = (first.path / "openvino_model.xml").read_text()
    assert "--task text-generation-with-past" in ir and "--weight-format fp32" in ir and str(model.resolve()) in ir
    assert json.loads((first.path / EXPORT_MARKER).read_text())["hash"] == first.hash
    again = exported(model, cache, tmp_path / "no-env-needed-now")  # a cache hit needs no export environment
    assert not again.exported_now and again.path == first.path
    assert (env / "bin" / "calls").read_text() == "x"
    (model / "model.safetensors").write_bytes(b"new weights")
    changed = exported(model, cache, env)
    assert changed.exported_now and changed.path != first.path and (env / "bin" / "calls").read_text() == "xx"
    assert sorted(p.name for p in cache.iterdir()) == sorted([first.path.name, changed.path.name])


def test_each_weight_format_is_its_own_export_with_its_own_flags(tmp_path):
    """The ladder's peer at specdec's bits: int8 and int4 exports of one checkpoint are cache entries of their own,
    keyed by the format's flags, and a format OpenVINO's export has no recipe for is refused before anything runs."""
    env, cache, model = fake_export_env(tmp_path / "env"), tmp_path / "cache", checkpoint(tmp_path / "m")
    runs = {weights: exported(model, cache, env, weights) for weights in ("fp32", "int8", "int4")}
    assert len({run.hash for run in runs.values()}) == 3
    for weights, run in runs.items():
        assert run.path == cache / f"{content_hash(model, weights)}-{weights}" and run.weights == weights
        assert run.as_dict()["recipe"].endswith(" ".join(WEIGHT_FORMATS[weights]))
    flags = {weights: (run.path / "openvino_model.xml").read_text() for weights, run in runs.items()}
    assert "--weight-format int8 --sym" in flags["int8"] and "--group-size" not in flags["int8"]
    assert "--weight-format int4 --sym --group-size 64 --ratio 1.0" in flags["int4"]
    assert not exported(model, cache, env, "int4").exported_now
    with pytest.raises(OpenVINOExportError, match=r"no OpenVINO export format 'nf4': choose one of fp32, int8, int4"):
        exported(model, cache, env, "nf4")
    assert (env / "bin" / "calls").read_text() == "xxx"


def test_a_failed_export_leaves_nothing_in_the_cache(tmp_path):
    env, cache = fake_export_env(tmp_path / "env", fail=True), tmp_path / "cache"
    with pytest.raises(OpenVINOExportError, match="conversion failed: unsupported model"):
        exported(checkpoint(tmp_path / "m"), cache, env)
    assert list(cache.iterdir()) == []


def test_a_failed_export_on_a_nearly_full_disk_says_so(tmp_path, monkeypatch):
    """optimum-cli writes the model uncompressed before compressing it, and on a full disk fails with an I/O error
    that names nothing: with less free space than twice the checkpoint, the error says what to do."""
    import specdec.bench.openvino_export as openvino_export

    env, cache, model = fake_export_env(tmp_path / "env", fail=True), tmp_path / "cache", checkpoint(tmp_path / "m")
    size = sum(p.stat().st_size for p in model.iterdir())
    usage = lambda free: lambda path: SimpleNamespace(total=10**12, used=0, free=free)  # noqa: E731
    monkeypatch.setattr(openvino_export.shutil, "disk_usage", usage(2 * size - 1))
    with pytest.raises(OpenVINOExportError, match=r"(?s)conversion failed.*less than twice the checkpoint's.*"
                                                  r"--openvino-cache DIR"):
        exported(model, cache, env)
    assert list(cache.iterdir()) == []
    monkeypatch.setattr(openvino_export.shutil, "disk_usage", usage(2 * size))
    with pytest.raises(OpenVINOExportError, match="conversion failed") as failed:
        exported(model, cache, env)
    assert "free" not in str(failed.value)


def test_a_missing_export_environment_names_the_setup_command(tmp_path):
    with pytest.raises(OpenVINOExportError, match=r"specdec bench --openvino-setup"):
        exported(checkpoint(tmp_path / "m"), tmp_path / "cache", tmp_path / "nowhere")
    assert not (tmp_path / "cache").exists() or list((tmp_path / "cache").iterdir()) == []


def test_export_env_setup_never_takes_over_a_foreign_directory(tmp_path):
    foreign = tmp_path / "mine"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("keep")
    with pytest.raises(OpenVINOExportError, match="not a finished OpenVINO export environment"):
        create_export_env(foreign)
    assert (foreign / "notes.txt").read_text() == "keep"


def test_cache_and_env_locations(monkeypatch, tmp_path):
    monkeypatch.delenv("SPECDEC_OPENVINO_CACHE", raising=False)
    monkeypatch.delenv("SPECDEC_OPENVINO_EXPORT_ENV", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert default_cache_dir() == tmp_path / "specdec" / "openvino"
    assert default_export_env() == tmp_path / "specdec" / "openvino" / "export-env"
    monkeypatch.setenv("SPECDEC_OPENVINO_CACHE", str(tmp_path / "c"))
    monkeypatch.setenv("SPECDEC_OPENVINO_EXPORT_ENV", str(tmp_path / "e"))
    assert default_cache_dir() == tmp_path / "c" and default_export_env() == tmp_path / "e"


# --------------------------------------------------------------------------------------------- end to end


def _exports_available() -> str | None:
    """Why the end-to-end tests cannot run here (None: they can)."""
    try:
        import openvino_genai  # noqa: F401
    except ImportError:
        return f"the openvino extra is not installed: {INSTALL_LINE}"
    cached = all((default_cache_dir() / f"{content_hash(default_assets_dir() / name)}-fp32" / EXPORT_MARKER).is_file()
                 for name in ("target", "draft"))
    if not cached and not (default_export_env() / "bin" / "optimum-cli").is_file():
        return (f"no cached OpenVINO export of the default pair in {default_cache_dir()} and no export environment "
                f"at {default_export_env()}: run `specdec bench --openvino-setup` (or `make test-openvino`)")
    return None


needs_openvino = pytest.mark.skipif(_exports_available() is not None, reason=_exports_available() or "")


@needs_openvino
def test_ov_methods_end_to_end_on_the_default_pair(tmp_path):
    """ov-plain and ov-speculative through the CLI: exported (or found) by content hash, float32 on one
    thread, greedy output token-identical to specdec's plain decoding and HF generate."""
    from specdec.cli import main

    out = tmp_path / "out"
    code = main(["bench", "--methods", "plain,ov-plain,ov-speculative", "--gamma", "2,4", "--num-prompts", "2",
                 "--max-new-tokens", "24", "--repeats", "1", "--warmup", "0", "--threads", "1", "--no-progress",
                 "--no-forward-costs", "--out", str(out)])
    assert code == 0
    results = json.loads((out / "results.json").read_text())
    by_label = {s["label"]: s for s in results["configs"]}
    assert set(by_label) == {"plain", "ov-plain", "ov-speculative@2", "ov-speculative@4"}
    for label in ("ov-plain", "ov-speculative@2", "ov-speculative@4"):
        s = by_label[label]
        assert s["identical_to_plain"] is True and s["identical_to_hf_plain"] is True, label
        assert s["new_tokens"] == 2 * 24
    assert by_label["ov-plain"]["tau"] == 1.0
    for gamma in (2, 4):
        s = by_label[f"ov-speculative@{gamma}"]
        assert 1.0 < s["tau"] <= gamma + 1 and s["drafted"] > 0 and s["draft_s"] > 0
    for run in (r for r in results["runs"] if r["method"] == "ov-speculative"):  # rounds vs OpenVINO's counters
        assert abs(run["drafted"] - run["ov_draft_tokens"]) <= run["gamma"] + 1
    peer = results["openvino"]
    assert peer["properties"] == {"INFERENCE_PRECISION_HINT": "f32", "KV_CACHE_PRECISION": "f32",
                                  "INFERENCE_NUM_THREADS": 1}
    assert peer["target"]["hash"] == content_hash(default_assets_dir() / "target")
    assert Path(peer["draft"]["path"]).name == f"{content_hash(default_assets_dir() / 'draft')}-fp32"
    assert results["settings"]["openvino"]["target_dir"] == str(default_assets_dir() / "target")


@needs_openvino
def test_ov_bfloat16_runs_where_the_plugin_has_bf16_else_names_the_fix():
    from specdec.bench.openvino_peer import OpenVINOPeer

    import openvino as ov

    root = default_assets_dir()
    settings = OpenVINOSettings(target_dir=str(root / "target"), draft_dir=str(root / "draft"))
    if "BF16" not in ov.Core().get_property("CPU", "OPTIMIZATION_CAPABILITIES"):
        # No native bf16 (AVX2): the plugin refuses a bf16 KV cache, so the peer says so and names the fix.
        with pytest.raises(ConfigError, match="--openvino-dtype float32"):
            OpenVINOPeer(settings, dtype=torch.bfloat16, threads=1, speculative=True)
        return
    # two threads: on one, OpenVINO's bf16 pipeline dies of SIGFPE on a CPU with AMX (refused by name, tested above)
    peer = OpenVINOPeer(settings, dtype=torch.bfloat16, threads=2, speculative=True)
    assert peer.describe()["properties"]["INFERENCE_PRECISION_HINT"] == "bf16"
    assert not peer.target_export.exported_now and not peer.draft_export.exported_now  # found by content hash
    prompt = [762, 677, 199, 762, 704, 581, 199, 477]
    plain = peer.run("ov-plain", None, prompt, max_new_tokens=12)
    spec = peer.run("ov-speculative", 3, prompt, max_new_tokens=12)
    assert len(plain.tokens) == len(spec.tokens) == 12 and spec.stats.target_forwards < 12


@needs_openvino
def test_ov_runs_ignore_end_of_sequence_like_every_bench_method():
    """The bench's configs make exactly max_new_tokens tokens even when an EOS / stop token comes up early."""
    import numpy as np
    import openvino as ov

    from specdec.bench.openvino_peer import OpenVINOPeer

    root = default_assets_dir()
    settings = OpenVINOSettings(target_dir=str(root / "target"), draft_dir=str(root / "draft"))
    peer = OpenVINOPeer(settings, dtype=torch.float32, threads=1, speculative=True)
    prompt = [762, 677, 199, 762, 704, 581, 199, 477]
    ids = ov.Tensor(np.asarray([prompt], dtype=np.int64))
    for speculative, gamma in ((False, None), (True, 3)):
        free = peer.run("ov-speculative" if speculative else "ov-plain", gamma, prompt, max_new_tokens=12).tokens
        stop = free[4]  # make the 5th token an end-of-sequence token
        config = peer.generation_config(max_new_tokens=12, temperature=0.0, top_k=None, top_p=None, seed=0,
                                        gamma=gamma)
        config.eos_token_id = stop
        config.stop_token_ids = {stop}
        assert [int(t) for t in peer.pipeline(speculative).generate(ids, config).tokens[0]] == free
        config.ignore_eos = False  # what the bench's config prevents: OpenVINO stops at the token
        assert len(peer.pipeline(speculative).generate(ids, config).tokens[0]) <= 5


@needs_openvino
def test_ov_plain_sampling_is_seeded_and_within_the_warp():
    """Sampling: one seed, one continuation; every draw inside the target's top-k (a probability-0 draw fails
    the exactness check outright). The full chi-square runs are benchmarks/openvino_exactness.py."""
    import specdec
    from specdec.bench.openvino_exactness import check_openvino_exactness
    from specdec.bench.openvino_peer import OpenVINOPeer

    target, _, _ = specdec.load_default()
    root = default_assets_dir()
    peer = OpenVINOPeer(OpenVINOSettings(target_dir=str(root / "target")), dtype=torch.float32, threads=1,
                        speculative=False)
    prompt = [762, 677, 199, 762, 704, 581, 199, 477]
    one = [peer.run("ov-plain", None, prompt, max_new_tokens=3, temperature=1.0, top_k=4, seed=s).tokens
           for s in (7, 7, 8)]
    assert one[0] == one[1]
    result = check_openvino_exactness(peer, target, prompt, method="ov-plain", temperature=1.0, top_k=4,
                                      max_new_tokens=2, samples=300)
    assert result.mode == "enumerate" and result.engine == "openvino" and result.test.impossible == 0
    with pytest.raises(ConfigError, match="temperature > 0"):
        check_openvino_exactness(peer, target, prompt, method="ov-plain", temperature=0.0)
