import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))

# Tiny test models gain nothing from intra-op threads, and oversubscribe a shared CPU badly.
torch.set_num_threads(1)


@pytest.fixture(autouse=True)
def _deterministic_torch():
    torch.manual_seed(0)
    yield
