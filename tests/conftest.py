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
        "implementation must pass (tests/test_exactness.py counts them in its family-wise bound)")


@pytest.fixture(autouse=True)
def _deterministic_torch():
    torch.manual_seed(0)
    yield
