"""../layer-graphs-zen4-1.5b/selfdraft_first.py with each g++ call inductor makes: its start, its seconds, its output."""
import logging, runpy, sys, time, collections, re
import torch._inductor.cpp_builder as cb
orig = cb.run_compile_cmd
t0 = time.perf_counter()
def timed(cmd_line, cwd):
    t = time.perf_counter(); orig(cmd_line, cwd); dt = time.perf_counter() - t
    out = re.search(r"-o (\S+)", cmd_line); name = out.group(1).rsplit("/", 1)[-1] if out else "?"
    print(f"{1000 * (t - t0):8.0f} ms g++ {dt:.2f} s {name[:40]}", flush=True)
cb.run_compile_cmd = timed
logging.basicConfig(level=logging.WARNING, format="%(relativeCreated)8.0f ms %(name)s %(message)s")
logging.getLogger("specdec.fastpath").setLevel(logging.INFO)
sys.argv = ["x"]
runpy.run_path("docs/bench/layer-graphs-zen4-1.5b/selfdraft_first.py", run_name="__main__")
