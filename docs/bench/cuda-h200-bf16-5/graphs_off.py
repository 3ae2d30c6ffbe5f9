"""Device check 5: `specdec bench` with the compiled path's CUDA graphs off (runtime/compiled.py, CUDA_GRAPHS),
so that a CUDA pass compiles as before: the C++ wrapper and frozen weights. The baseline of the A/B."""
import sys

import specdec.runtime.compiled as compiled
from specdec.cli import main

compiled.CUDA_GRAPHS = False
sys.argv = ["specdec", "bench", *sys.argv[1:]]
main()
