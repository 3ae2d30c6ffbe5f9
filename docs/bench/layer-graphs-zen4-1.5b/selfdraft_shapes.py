"""The self-draft first-request probe (selfdraft_first.py) with each compiled shape and its seconds logged."""
import logging, runpy, sys, time
logging.basicConfig(level=logging.WARNING, format="%(relativeCreated)8.0f ms %(name)s %(message)s")
logging.getLogger("specdec.fastpath").setLevel(logging.INFO)
sys.argv = ["x"]
runpy.run_path("docs/bench/layer-graphs-zen4-1.5b/selfdraft_first.py", run_name="__main__")
