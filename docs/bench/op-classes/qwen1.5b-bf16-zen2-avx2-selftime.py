"""From the repository root: python docs/bench/op-classes/qwen1.5b-bf16-zen2-avx2-selftime.py CHECKPOINT
(the checkpoint: `benchmarks/size_ladder.py --save qwen2.5-1.5b DIR`)."""
import sys, time, statistics, torch
sys.path.insert(0, "benchmarks")  # run from the repository root
import op_classes as oc
from pathlib import Path
torch.set_num_threads(1)
model = oc.load(Path(sys.argv[1]), torch.bfloat16, "bfloat16")
g = torch.Generator().manual_seed(0)
prompt = torch.randint(8, model.config.vocab_size, (96,), generator=g)
side = oc.SpecdecSide(model, "specdec", prompt, (1,), 256, profiling=True)
side.run(1, 4)
print("wall ms", [round(t*1e3,1) for t in side.run(1, 8)])
with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
    side.run(1, 8)
print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25, max_name_column_width=70))
