"""One thread policy for the library, the CLI and the server (README "Threads", specdec/runtime/threads.py).

The measurement is replaced by a stub that says which count is faster (`pass_seconds`), and a forward
pre-hook on the target records the torch thread count each pass really ran with.
"""

from __future__ import annotations

import threading
import time

import pytest
import torch
from models import tiny, tiny_tokenizer

import specdec
import specdec.runtime.threads as threads
from specdec.cli import main as cli_main


@pytest.fixture
def torch_two_threads():
    """The caller's torch count is 2 (as torch's default on a 2-core machine); restored afterwards."""
    before = torch.get_num_threads()
    threads.set_threads("auto")  # whatever an earlier test (a CLI run with --threads) pinned
    torch.set_num_threads(2)
    yield
    threads.set_threads("auto")
    torch.set_num_threads(before)


def timed_as(monkeypatch, seconds: dict[int, float]) -> list[int]:
    """Make every measurement report these one-token pass times; returns a list counting measurements."""
    calls = []

    def fake(model, counts):
        calls.append(1)
        return {n: seconds[n] for n in counts}

    monkeypatch.setattr(threads, "pass_seconds", fake)
    return calls


def recorded(model) -> list[int]:
    seen: list[int] = []
    model.register_forward_pre_hook(lambda *_: seen.append(torch.get_num_threads()))
    return seen


def test_the_rule_wants_a_clear_win_for_more_threads():
    assert threads.choose({1: 1.0, 2: 0.9}) == 1  # 1.11x faster: not worth the risk of a busy core
    assert threads.choose({1: 1.0, 2: 0.8}) == 2
    assert threads.choose({1: 1.0, 2: 10.0}) == 1
    assert threads.choose({1: 1.0, 4: 0.5, 8: 0.6}) == 4


def test_decoding_runs_with_the_measured_count_and_restores_the_callers(monkeypatch, torch_two_threads):
    calls = timed_as(monkeypatch, {1: 0.001, 2: 0.010})  # 1 thread is 10x faster: a busy core
    target, draft = tiny("llama", layers=1), tiny("llama", layers=1)
    seen = recorded(target)
    specdec.generate(target, [1, 2, 3], drafter=specdec.DraftModel(draft), max_new_tokens=6)
    assert seen and set(seen) == {1}
    assert torch.get_num_threads() == 2
    seen.clear()
    for _ in specdec.stream(target, [1, 2, 3], max_new_tokens=4):
        assert torch.get_num_threads() == 2  # the caller's own count between tokens
    assert set(seen) == {1}
    seen.clear()
    specdec.generate_batch(target, [[1, 2, 3], [4, 5]], drafter=specdec.DraftModel(draft), max_new_tokens=4)
    assert set(seen) == {1} and torch.get_num_threads() == 2
    assert len(calls) == 1  # measured once for this model, then reused


def test_more_threads_when_they_measure_faster(monkeypatch, torch_two_threads):
    timed_as(monkeypatch, {1: 0.010, 2: 0.002})
    target = tiny("llama", layers=1)
    seen = recorded(target)
    specdec.generate(target, [1, 2, 3], max_new_tokens=4)
    assert set(seen) == {2}


def test_set_threads_is_the_users_choice_and_auto_goes_back(monkeypatch, torch_two_threads):
    calls = timed_as(monkeypatch, {1: 0.001, 2: 0.010})
    target = tiny("llama", layers=1)
    seen = recorded(target)
    specdec.set_threads(2)
    specdec.generate(target, [1, 2, 3], max_new_tokens=4)
    assert set(seen) == {2} and not calls and threads.explicit_threads() == 2
    specdec.set_threads("auto")
    seen.clear()
    specdec.generate(target, [1, 2, 3], max_new_tokens=4)
    assert set(seen) == {1} and len(calls) == 1
    with pytest.raises(specdec.ConfigError, match="threads"):
        specdec.set_threads(0)


def test_an_old_measurement_is_repeated(monkeypatch, torch_two_threads):
    calls = timed_as(monkeypatch, {1: 0.001, 2: 0.010})
    target = tiny("llama", layers=1)
    specdec.generate(target, [1, 2, 3], max_new_tokens=2)
    specdec.generate(target, [1, 2, 3], max_new_tokens=2)
    assert len(calls) == 1
    monkeypatch.setattr(threads, "RECHECK_S", 0.0)
    monkeypatch.setattr(threads, "MEASURE_SHARE", 1.0)
    timed_as_now = timed_as(monkeypatch, {1: 0.010, 2: 0.001})  # the machine became idle
    seen = recorded(target)
    specdec.generate(target, [1, 2, 3], max_new_tokens=2)
    assert len(timed_as_now) == 1 and set(seen) == {2}


def test_one_thread_callers_are_not_measured(monkeypatch):
    calls = timed_as(monkeypatch, {1: 0.001, 2: 0.010})
    assert torch.get_num_threads() == 1  # tests/conftest.py
    specdec.generate(tiny("llama", layers=1), [1, 2, 3], max_new_tokens=2)
    assert not calls


@pytest.mark.parametrize("arch", ["llama", "t5", "bart", "whisper"])
def test_the_measurement_times_a_one_token_pass(arch, torch_two_threads):
    if arch == "llama":
        model = tiny("llama", layers=1)
    else:
        from seq2seq_models import tiny_seq2seq

        model = tiny_seq2seq(arch)
    seconds = threads.pass_seconds(model, (1, 2))
    assert set(seconds) == {1, 2} and all(s > 0 for s in seconds.values())
    assert torch.get_num_threads() == 2
    choice = threads.measure(model, 2)
    assert choice.threads in (1, 2) and "one-token target pass" in choice.describe()


def test_the_servers_scheduler_thread_decodes_with_the_same_count(monkeypatch, torch_two_threads):
    openai = pytest.importorskip("openai")
    uvicorn = pytest.importorskip("uvicorn")
    from specdec.server import create_app

    timed_as(monkeypatch, {1: 0.001, 2: 0.010})
    tokenizer = tiny_tokenizer()
    target = tiny("llama", hidden=32, layers=1, vocab=len(tokenizer))
    seen = recorded(target)
    server = uvicorn.Server(uvicorn.Config(create_app(target, tokenizer, specdec.PromptLookup(), model_name="t"),
                                           host="127.0.0.1", port=0, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 20
        while not server.started:
            assert time.monotonic() < deadline, "uvicorn did not start"
            time.sleep(0.02)
        port = server.servers[0].sockets[0].getsockname()[1]
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0, timeout=30)
        seen.clear()
        out = client.completions.create(model="t", prompt="def f(x):", max_tokens=6, temperature=0)
        assert out.usage.completion_tokens == 6
    finally:
        server.should_exit = True
        thread.join(timeout=30)
    assert seen and set(seen) == {1}


@pytest.fixture
def saved_model(tmp_path):
    tokenizer = tiny_tokenizer()
    model = tiny("llama", layers=1, vocab=len(tokenizer))
    model.save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    return str(tmp_path)


def test_the_cli_uses_the_same_policy(monkeypatch, torch_two_threads, saved_model, capsys):
    timed_as(monkeypatch, {1: 0.001, 2: 0.010})
    assert cli_main(["generate", "--target", saved_model, "--prompt", "def f(", "--max-new-tokens", "3"]) == 0
    assert "1 thread" in capsys.readouterr().err
    assert torch.get_num_threads() == 2 and threads.explicit_threads() is None  # nothing pinned for the process
    assert cli_main(["generate", "--target", saved_model, "--prompt", "def f(", "--max-new-tokens", "3",
                     "--threads", "2"]) == 0
    assert "2 threads" in capsys.readouterr().err and threads.explicit_threads() == 2


@pytest.mark.parametrize("value", ["0", "x", "-2"])
def test_a_bad_threads_value_is_one_line(value, capsys):
    assert cli_main(["generate", "--prompt", "x", "--threads", value]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("specdec: error:") and "--threads" in err and "\n" not in err


def test_a_model_whose_bare_pass_fails_keeps_the_callers_count(monkeypatch, torch_two_threads):
    def broken(model, counts):
        raise TypeError("this model needs more inputs")

    monkeypatch.setattr(threads, "pass_seconds", broken)
    target = tiny("llama", layers=1)
    seen = recorded(target)
    specdec.generate(target, [1, 2, 3], max_new_tokens=2)
    assert set(seen) == {2} and "not measured: its bare pass failed" in threads.last_choice(target).describe()


def test_a_large_model_keeps_torchs_count_unmeasured(monkeypatch, torch_two_threads):
    calls = timed_as(monkeypatch, {1: 0.001, 2: 0.010})
    monkeypatch.setattr(threads, "LARGE_MODEL_PARAMETERS", 1000)  # the tiny model counts as large
    target = tiny("llama", layers=1)
    seen = recorded(target)
    specdec.generate(target, [1, 2, 3], max_new_tokens=2)
    assert set(seen) == {2} and not calls and "parameters" in threads.last_choice(target).describe()
