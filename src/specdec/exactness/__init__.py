"""Statistical exactness checks: does a decoding method sample from the exact warped target distribution?

    from specdec.exactness import check_exactness
    result = check_exactness(target, prompt_ids, specdec.DraftModel(draft), gamma=3, temperature=0.7,
                             top_k=8, max_new_tokens=3, samples=20_000)
    result.verdict, result.p_value, result.tv, result.tv_ci, result.detectable_tv, result.to_dict()

The reference is computed exactly from the target (`reference`), the draws come from the real decode loop
(`engine`), the statistics are in `gof`; `warp` holds the reference warp, written separately from the
decoder's. The deliberately broken verifiers of the negative controls live with the tests (tests/faulty.py).
`greedy.check_greedy` is the deterministic check: greedy output token-identical to plain decoding, prompt by
prompt, with the plain pass's top-2 gap at each divergence. See docs/exactness.md.
"""

from specdec.exactness.engine import ENGINES, Draws, MemoUnsupported, draw
from specdec.exactness.gof import (
    DEFAULT_POWER,
    MIN_EXPECTED,
    TestOutcome,
    detectable_tv,
    g_statistic,
    multinomial_test,
    pool_cells,
    pooled_conditional_test,
    power_at,
)
from specdec.exactness.greedy import NEAR_TIE_ULPS, Divergence, GreedyReport, PlainReference, check_greedy, plain_reference
from specdec.exactness.reference import Enumeration, EnumerationTooLarge, enumerate_continuations, iter_conditionals
from specdec.exactness.verifier import DEFAULT_ALPHA, MODES, ExactnessResult, check_exactness
from specdec.exactness.warp import reference_warp

__all__ = [
    "DEFAULT_ALPHA", "DEFAULT_POWER", "ENGINES", "MIN_EXPECTED", "MODES", "NEAR_TIE_ULPS", "Divergence", "Draws",
    "Enumeration", "EnumerationTooLarge", "ExactnessResult", "GreedyReport", "MemoUnsupported", "PlainReference",
    "TestOutcome", "check_exactness", "check_greedy",
    "detectable_tv", "draw", "enumerate_continuations", "g_statistic", "iter_conditionals", "multinomial_test",
    "plain_reference", "pool_cells", "pooled_conditional_test", "power_at", "reference_warp",
]
