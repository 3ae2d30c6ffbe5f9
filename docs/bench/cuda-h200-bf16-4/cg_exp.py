"""Device check 4, second call: inductor's CUDA graphs need the Python wrapper (cpp_wrapper off)."""
import sys

import specdec.runtime.compiled as compiled
from specdec.cli import main

compiled.COMPILE_OPTIONS = {**compiled.COMPILE_OPTIONS, "cpp_wrapper": False, "cpp_wrapper_build_separate": False}
sys.argv = ["specdec", "bench", *sys.argv[1:]]
main()
