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
