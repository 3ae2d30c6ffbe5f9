import sys, time, torch
import specdec
from specdec.server.scheduler import Scheduler
t0 = time.perf_counter()
target, draft, tok = specdec.load_default(dtype=torch.float32)
torch.set_num_threads(1)
s = Scheduler(target, specdec.DraftModel(draft), max_batch=32, max_gamma=4, compile=True)
t1 = time.perf_counter()
s.precompile()
print("precompile", round(time.perf_counter() - t1, 1), "s; process", round(time.perf_counter() - t0, 1), flush=True)
from torch._dynamo.utils import compile_times
print(compile_times(repr="str"))
