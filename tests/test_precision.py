"""`dtype="auto"`'s rule on a CPU (runtime/precision.py): bfloat16 when its measured speed-ups over float32 at one
row and at eight rows have a geometric mean of at least 1.25 and neither is below 1."""

from __future__ import annotations

import pytest
import torch

from specdec.runtime.precision import NATIVE_SPEEDUP, auto_dtype, bf16_pays


@pytest.mark.parametrize(("float32_ms", "bfloat16_ms", "pays"), [
    ([2.0, 3.2], [1.0, 1.6], True),     # 2x at both (a CPU with a bfloat16 dot product)
    ([2.0, 3.25], [1.05, 2.65], True),  # the AVX2 Zen 3: 1.9x at one row, 1.23x at eight (geometric mean 1.53)
    ([2.0, 3.0], [1.0, 3.1], False),    # faster at one row, slower at eight
    ([2.2, 15.5], [2.8, 40.6], False),  # bfloat16 converted in a slow loop: slower at both
    ([1.2, 1.2], [1.0, 1.0], False),    # 1.2x at both: below the bar
])
def test_bfloat16_is_chosen_where_it_pays_at_one_and_eight_rows(float32_ms, bfloat16_ms, pays):
    assert bf16_pays(float32_ms, bfloat16_ms) is pays


def test_the_bar_is_the_geometric_mean():
    at_one_row = NATIVE_SPEEDUP**2 / 1.01  # with 1.01x at eight rows: a geometric mean of exactly the bar
    assert not bf16_pays([0.99 * at_one_row, 1.01], [1.0, 1.0])
    assert bf16_pays([1.01 * at_one_row, 1.01], [1.0, 1.0])


def test_auto_is_one_of_the_two():
    assert auto_dtype("cpu") in (torch.float32, torch.bfloat16)
    assert auto_dtype("meta") == torch.float32


def test_a_server_keeps_bfloat16_only_where_its_batched_kernel_is_no_slower(monkeypatch):
    """`specdec serve --dtype auto`: the one-row verdict, then the batched passes' linear kernel at 32 rows must be
    1.25x faster in bfloat16 (the AVX2 Zen 3's measured times: eager bfloat16 runs `row_linear`, 7x float32's
    `F.linear`; compiled, 1.05x, and the compiled decoder ran bfloat16 at 0.8x float32 there)."""
    from specdec.runtime import precision

    zen3 = {False: (10.7, 74.6), True: (7.0, 6.7)}
    monkeypatch.setattr(precision, "batched_linear_ms", lambda compiled: zen3[compiled])
    monkeypatch.setattr(precision, "auto_dtype", lambda device: torch.bfloat16)
    assert precision.serving_dtype("cpu", compiled=False) == torch.float32
    assert precision.serving_dtype("cpu", compiled=True) == torch.float32
    native = {False: (10.7, 5.0), True: (7.0, 3.5)}  # a CPU with a bfloat16 dot product
    monkeypatch.setattr(precision, "batched_linear_ms", lambda compiled: native[compiled])
    assert precision.serving_dtype("cpu", compiled=False) == precision.serving_dtype("cpu", compiled=True) == torch.bfloat16
    monkeypatch.setattr(precision, "auto_dtype", lambda device: torch.float32)  # one row already says float32
    assert precision.serving_dtype("cpu", compiled=True) == torch.float32


def test_the_batched_kernels_are_measured_once_per_machine_and_path(monkeypatch, tmp_path):
    from specdec.runtime import precision

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    calls = []
    monkeypatch.setattr(precision, "measure_batched", lambda compiled: calls.append(compiled) or [1.0, 2.0 + compiled])
    assert precision.batched_linear_ms(False) == (1.0, 2.0)
    assert precision.batched_linear_ms(True) == (1.0, 3.0)
    assert precision.batched_linear_ms(False) == (1.0, 2.0)
    assert calls == [False, True]  # the third answer came from the cache file
    assert "batched_ms" in next(iter(precision.read_cache(tmp_path / "specdec" / "precision.json").values()))
    # the one-row verdict, measured afterwards, keeps them
    monkeypatch.setattr(precision, "_measure", lambda: ([2.0, 3.2], [1.0, 1.6]))
    precision.cpu_computes_bf16.cache_clear()
    try:
        assert precision.cpu_computes_bf16()
    finally:
        precision.cpu_computes_bf16.cache_clear()
    entry = next(iter(precision.read_cache(tmp_path / "specdec" / "precision.json").values()))
    assert entry["float32_ms"] == [2.0, 3.2] and entry["batched_ms"]["eager"] == [1.0, 2.0]


@pytest.mark.parametrize("compiled", [False, True])
def test_the_batched_measurement_times_both_dtypes(compiled):
    from specdec.runtime.precision import measure_batched

    float32_ms, bfloat16_ms = measure_batched(compiled, repeats=1)
    assert 0 < float32_ms < 10_000 and 0 < bfloat16_ms < 10_000
