import time, torch
from specdec.runtime.compiled import COMPILE_OPTIONS
from specdec.runtime.rowwise import vector_isa_proven
t = time.perf_counter()
isa = {"cpp.vec_isa_ok": True} if vector_isa_proven() else {}
x = torch.randn(1536, dtype=torch.bfloat16)
for wrapper in ({"cpp_wrapper": False, "cpp_wrapper_build_separate": False}, {}):
    f = torch.compile(lambda v: torch.nn.functional.silu(v.float()).to(torch.bfloat16) * v, options={**COMPILE_OPTIONS, **wrapper, **isa})
    with torch.inference_mode():
        f(x)
    torch._dynamo.reset()
print("warm %.1f s" % (time.perf_counter() - t))
