"""From the repository root: python docs/bench/op-classes/qwen1.5b-bf16-zen2-avx2-asserts.py CHECKPOINT
(the checkpoint: `benchmarks/size_ladder.py --save qwen2.5-1.5b DIR`)."""
import sys, time, statistics, copy, torch
sys.path.insert(0, "benchmarks")  # run from the repository root
import op_classes as oc
from pathlib import Path
from torch._inductor import config as ic
torch.set_num_threads(1)
model = oc.load(Path(sys.argv[1]), torch.bfloat16, "bfloat16")
model_b = copy.deepcopy(model)
g = torch.Generator().manual_seed(0)
prompt = torch.randint(8, model.config.vocab_size, (96,), generator=g)
a = oc.SpecdecSide(model, "specdec", prompt, (1,), 256)
with ic.patch(size_asserts=False):
    b = oc.SpecdecSide(model_b, "specdec", prompt, (1,), 256)
ta, tb = [], []
a.run(1, 4); b.run(1, 4)
for _ in range(10):
    ta += a.run(1, 8); tb += b.run(1, 8)
ma, mb = statistics.median(ta) * 1e3, statistics.median(tb) * 1e3
print(f"asserts on {ma:.2f} ms, off {mb:.2f} ms, off/on {mb/ma:.3f}; min {min(ta)*1e3:.2f} / {min(tb)*1e3:.2f}")
