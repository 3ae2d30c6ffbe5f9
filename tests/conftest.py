import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))

# Tiny test models gain nothing from intra-op threads, and oversubscribe a shared CPU badly.
torch.set_num_threads(1)


def pytest_configure(config):
    config.addinivalue_line(
        "markers", "exactness_positive(checks, alpha): runs statistical exactness checks a correct "
        "implementation must pass (tests/test_exactness.py counts them in its family-wise bound); implies "
        "`statistical`")


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    """A test that declares positive exactness checks is a statistical one (the default tier leaves it out)."""
    for item in items:
        if item.get_closest_marker("exactness_positive") is not None:
            item.add_marker(pytest.mark.statistical)


@pytest.fixture(autouse=True)
def _compiling_tests_are_marked(request, monkeypatch):
    """A test that calls torch.compile must be marked `compile` (an inductor compile takes seconds to minutes a
    shape on a CPU), so that the default tier, which leaves those out, stays fast."""
    calls = []
    real = torch.compile

    def counted(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(torch, "compile", counted)
    yield
    assert not calls or request.node.get_closest_marker("compile") is not None, (
        f"{request.node.name} calls torch.compile: mark it @pytest.mark.compile")


@pytest.fixture(autouse=True)
def _self_draft_verdicts_stay_in_the_test(tmp_path, monkeypatch):
    """`choose_self_draft` caches its verdicts in the test's folder, not the user's cache: every test measures
    afresh, and a test run leaves nothing in ~/.cache/specdec."""
    from specdec.engine import self_draft_choice

    monkeypatch.setattr(self_draft_choice, "cache_file", lambda name: tmp_path / "specdec-cache" / name)


@pytest.fixture(autouse=True)
def _deterministic_torch():
    torch.manual_seed(0)
    yield


FAULTY_MODULE = "faulty"  # tests/faulty.py, imported from this directory


@pytest.fixture(autouse=True)
def _positive_exactness_checks_are_declared(request, monkeypatch):
    """Counts the `check_exactness` runs of a test that a correct implementation must pass (T > 0, the real
    verifiers, no model or drafter from tests/faulty.py) and requires the test to declare them with
    @pytest.mark.exactness_positive(checks=..., alpha=...), so the family-wise bound in test_exactness.py
    covers every statistical check of the suite."""
    import specdec.exactness

    real = specdec.exactness.check_exactness
    ran: list[float] = []

    def counted(target, prompt_ids, drafter=None, **kwargs):
        result = real(target, prompt_ids, drafter, **kwargs)
        faulty = ("verify_fn" in kwargs or "tree_verify_fn" in kwargs
                  or FAULTY_MODULE in (type(target).__module__, type(drafter).__module__))
        if not faulty and result.settings["temperature"] > 0:
            ran.append(result.settings["alpha"])
        return result

    monkeypatch.setattr(specdec.exactness, "check_exactness", counted)  # what the CLI calls
    if getattr(request.module, "check_exactness", None) is real:
        monkeypatch.setattr(request.module, "check_exactness", counted)
    yield
    marker = request.node.get_closest_marker("exactness_positive")
    checks, alpha = (marker.kwargs["checks"], marker.kwargs["alpha"]) if marker else (0, 0.0)
    assert len(ran) <= checks and all(a <= alpha for a in ran), (
        f"{request.node.name} ran {len(ran)} positive exactness checks at levels {ran}, but declares {checks} "
        f"at level {alpha}: mark it @pytest.mark.exactness_positive(checks=..., alpha=...) so that the "
        "family-wise bound in tests/test_exactness.py counts it"
    )
