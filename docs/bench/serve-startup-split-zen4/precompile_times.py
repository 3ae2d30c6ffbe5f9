"""The warm start-up's compiles of `specdec serve --compile --max-batch 32 --drafter draft` (float32, γ up to 4):
the scheduler's `precompile`, timed, then torch's own compile timers per phase (log.md)."""

import time

import torch

import specdec
from specdec.server.scheduler import Scheduler

start = time.perf_counter()
target, draft, _ = specdec.load_default(dtype=torch.float32)
torch.set_num_threads(1)
scheduler = Scheduler(target, specdec.DraftModel(draft), max_batch=32, max_gamma=4, compile=True)
compiling = time.perf_counter()
scheduler.precompile()
print("precompile", round(time.perf_counter() - compiling, 1), "s; process", round(time.perf_counter() - start, 1),
      flush=True)

from torch._dynamo.utils import compile_times  # noqa: E402

print(compile_times(repr="str"))
