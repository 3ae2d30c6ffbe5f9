"""`make install` builds inductor's precompiled headers (`compiled.precompile_headers`), so that the fast path's
first compile does not: the headers it makes must be the ones a model's compile would make, in both wrappers (a
model compiled whole, on the C++ wrapper, and one compiled by layer, on the Python wrapper)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from specdec.runtime.compiled import compiler_problem

# In a process of its own, so that the temporary directory where inductor keeps the headers, and its cache, are new
# (a cached graph would compile no kernel, and read no header).
CODE = r"""
import sys
from pathlib import Path

import torch

sys.path.insert(0, sys.argv[2])
from models import tiny

from specdec.runtime import compiled, layer_graphs
from specdec.runtime.static_lm import StaticCausalLM

root = Path(sys.argv[1])
headers = lambda: sorted(p.name for p in root.rglob("*.gch"))
compiled.precompile_headers()
made = headers()
for by_layer in (False, True):
    layer_graphs.LAYER_GRAPHS_MIN_BYTES = 0 if by_layer else 1 << 40
    model = tiny("llama", hidden=64, layers=2, dtype=torch.bfloat16)
    adapter = StaticCausalLM(model, compile=True, max_len=64)
    assert bool(compiled.entry_for(model).layers) == by_layer
    adapter.prefill(torch.arange(5, 17))
    adapter.forward(torch.tensor([7]))
print(len(made), len(set(headers()) - set(made)))
"""


@pytest.mark.skipif(compiler_problem() is not None, reason="needs a C++ compiler")
def test_install_time_headers_are_the_ones_a_first_compile_uses(tmp_path: Path):
    env = {**os.environ, "TMPDIR": str(tmp_path), "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor")}
    out = subprocess.run([sys.executable, "-c", CODE, str(tmp_path), str(Path(__file__).parent)], env=env,
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    made, new = map(int, out.stdout.split()[-2:])
    assert made >= 1  # the headers exist, under the temporary directory
    assert new == 0  # and neither wrapper's compile built one of its own
