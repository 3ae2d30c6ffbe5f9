"""Untimed τ at T = 1 (top-k 50, top-p 0.9, 128 new tokens) of draft chains and MultiDraft trees on the default
pair, code and edit prompts, one JSON line per run (BENCHMARKS.md, "Token trees", T = 1 multi-draft).

    python scripts/multi_draft_tau.py OUT.jsonl PROMPT_SEED NUM_PROMPTS NUM_SEEDS CONFIG...
    python scripts/multi_draft_tau.py --summary OUT.jsonl

CONFIG: "chain:γ" or "SCHEME:W1xW2...:γ" (SCHEME rrs | specinfer | spectr; widths per level; γ levels).
target_s / draft_s are recorded but only comparable between runs of the same (prompt, seed), interleaved.
"""
import json, sys, time, torch
torch.set_num_threads(1)
import specdec
from specdec.bench.workloads import load_workload
from specdec.engine.decoding import SpeculativeDecoder
from specdec.hub.default_pair import load_default

if sys.argv[1] == "--summary":
    import runpy
    sys.argv = [sys.argv[0], sys.argv[2]]
    runpy.run_path(__file__.replace("multi_draft_tau.py", "multi_draft_summary.py"), run_name="__main__")
    sys.exit(0)
out, pseed, nprompts, nseeds = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
configs = sys.argv[5:]  # "chain:G" | "SCHEME:W1xW2:G"
target, draft, tok = load_default()
drafters = {}
def make(cfg):
    parts = cfg.split(":")
    if parts[0] == "chain":
        return specdec.DraftModel(draft), int(parts[1])
    widths = tuple(int(w) for w in parts[1].split("x"))
    return specdec.MultiDraft(draft, scheme=parts[0], widths=widths), int(parts[2])
workloads = {wl: load_workload(wl, tok, nprompts, seed=pseed) for wl in ("code", "edit")}
with open(out, "a") as f:
  for s in range(nseeds):
    for pi in range(nprompts):
        for wl, prompts in workloads.items():
            pr = prompts[pi]
            for cfg in configs:
                d, g = make(cfg)
                dec = SpeculativeDecoder(target, d, gamma=g, max_new_tokens=128, temperature=1.0, top_k=50,
                                         top_p=0.9, seed=1000 * s + pi, eos_token_id=[])
                t = time.perf_counter()
                list(dec.stream(pr.ids))
                st = dec.stats
                rec = dict(cfg=cfg, wl=wl, prompt=pi, seed=s, tau=st.mean_accepted_tokens, rounds=st.rounds,
                           drafted=st.drafted, accepted=st.accepted, wall=time.perf_counter() - t,
                           target_s=st.target_s, draft_s=st.draft_s)
                f.write(json.dumps(rec) + "\n"); f.flush()
