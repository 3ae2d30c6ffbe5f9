"""A self-drafted 1.5B target's first request (w4a8 copy, gamma="auto", 16 tokens from 64), this tree's compile
options against the previous ones (OLD=1: a model compiled by layer frozen, with the linear-fusing pass keyed on its
weights' hash), in one probe; one line per request."""
import os, resource, runpy, time
import torch
from torch._dynamo.utils import counters
import specdec
from specdec.engine.decoding import SpeculativeDecoder
from specdec.runtime import compiled
from specdec.runtime.fuse_linears import FuseRowLinears, weights_fingerprint
from specdec.runtime.shared_kv_heads import ShareKVHeads
from specdec.runtime.compute_once import ComputeOnce
from specdec.runtime.weights import pack_model


# OLD=1 reproduces d7d234b only on the code of e815520..af2ab3b: later, dynamo's prepare_freezing follows the
# `freezing` option, so these options would freeze a by-layer model's parameters for dynamo too.
def previous_options(self) -> dict:  # Compiled.options before LAYER_GRAPH_OPTIONS (d7d234b)
    if self._weights is None:
        self._weights = weights_fingerprint(self._model())
    wrapper = compiled.cpu_wrapper_options(python_wrapper=bool(self.layers))
    return {**compiled.COMPILE_OPTIONS, **wrapper,
            "joint_custom_pre_pass": FuseRowLinears(shared=self.copies, weights=self._weights),
            "post_grad_custom_pre_pass": ShareKVHeads(), "post_grad_custom_post_pass": ComputeOnce(),
            "guard_filter_fn": compiled.argument_guards}


label = "previous (frozen)" if os.environ.get("OLD") == "1" else "this tree (not frozen)"
if os.environ.get("OLD") == "1":
    compiled.Compiled.options = previous_options
ladder = runpy.run_path("benchmarks/size_ladder.py", run_name="size_ladder")
torch.set_num_threads(1)
model = ladder["build"]("qwen2.5-1.5b", torch.bfloat16)
pack_model(model, "bfloat16")
prompt = torch.randint(0, model.config.vocab_size, (64,), generator=torch.Generator().manual_seed(0))
decoder = SpeculativeDecoder(model, specdec.SelfDraft(model, "w4a8"), gamma="auto", max_new_tokens=16,
                             compile=True, eos_token_id=[])
start = time.perf_counter()
out = list(decoder.stream(prompt))
first = time.perf_counter() - start
compile_s = decoder.stats.compile_s  # the first request's
start = time.perf_counter()
again = list(decoder.stream(prompt))
second = time.perf_counter() - start
assert again == out
cache = {k: v for k, v in {**counters["inductor"], **counters["aot_autograd"]}.items() if "cache" in k}
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # GiB (ru_maxrss is in KiB on Linux)
print(f"{label}: first request {first:.1f} s, compile {compile_s:.1f} s, second request "
      f"{second:.1f} s, tokens {out[:6]}, peak RSS {peak:.2f} GiB, {cache}", flush=True)
