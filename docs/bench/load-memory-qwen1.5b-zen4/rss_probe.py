import threading, time, torch, sys
from specdec.hub.loading import load_model
torch.set_num_threads(1)
best = {"VmRSS": 0}
stop = False
def status():
    d = {}
    for line in open("/proc/self/status"):
        k, v = line.split(":", 1)
        if k in ("VmRSS", "RssAnon", "RssFile", "RssShmem"):
            d[k] = int(v.split()[0]) / 2**20
    return d
def sample():
    import traceback
    main = threading.main_thread()
    while not stop:
        d = status()
        if d["VmRSS"] > best["VmRSS"]:
            best.update(d)
            frame = sys._current_frames()[main.ident]
            best["where"] = " <- ".join(f"{f.name}:{f.lineno}" for f in traceback.extract_stack(frame)[-6:][::-1])
        time.sleep(0.02)
t = threading.Thread(target=sample, daemon=True); t.start()
print("start", status())
m = load_model(sys.argv[1], dtype=torch.bfloat16, weights=sys.argv[2])
time.sleep(0.2); stop = True
print("end", status())
print("peak", {k: (round(v, 3) if isinstance(v, float) else v) for k, v in best.items()})
import ctypes, gc
gc.collect()
ctypes.CDLL("libc.so.6").malloc_trim(0)
print("after trim", status())
sys.path.insert(0, "benchmarks"); from load_memory import model_bytes; print("model GB", model_bytes(m) / 2**30)
