"""../layer-graphs-zen4-1.5b/selfdraft_first.py with g++'s time and inductor's compile-time table."""
import logging, runpy, sys, time, collections
import torch._inductor.cpp_builder as cb
stats = collections.Counter(); count = collections.Counter()
orig = cb.run_compile_cmd
def timed(cmd_line, cwd):
    t = time.perf_counter(); orig(cmd_line, cwd); dt = time.perf_counter() - t
    kind = "link/so" if " -shared" in cmd_line else "other"
    kind = "pch" if ".gch" in cmd_line and "-include" not in cmd_line.split(".gch")[0][-50:] else kind
    stats[kind] += dt; count[kind] += 1
cb.run_compile_cmd = timed
logging.basicConfig(level=logging.WARNING, format="%(relativeCreated)8.0f ms %(name)s %(message)s")
logging.getLogger("specdec.fastpath").setLevel(logging.INFO)
sys.argv = ["x"]
t0 = time.perf_counter()
runpy.run_path("docs/bench/layer-graphs-zen4-1.5b/selfdraft_first.py", run_name="__main__")
print("g++:", {k: (count[k], round(v, 1)) for k, v in stats.items()})
import torch._dynamo.utils as du
print(du.compile_times(repr="str", aggregate=True))
