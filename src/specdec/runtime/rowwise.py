"""Row-invariant kernels: attention and linear layers whose every output row is computed on its own.

A library kernel (PyTorch's CPU flash attention, a batched matmul, a BLAS GEMM) picks its blocking, and so its
reduction order, from the number of rows it is given; in low precision a token's logits then depend on whether it
was scored alone, in a γ+1-row verification pass, in a tree or next to other requests, and greedy speculative
output drifts from plain decoding at near-ties. The two kernels here (kernels/*.cpp) compute every row with the
same loops in the same order whatever the pass holds, so they cannot:

- `specdec::row_attention` for `F.scaled_dot_product_attention` (with an explicit mask);
- `specdec::row_linear` for `F.linear`: small-row-count GEMMs that read each weight once for a block of rows, with
  the CPU's bf16 dot-product instruction where it has one.

Two more serve the compiled fast path's graphs: `specdec::packed_linear` (pre-packed weights, wired by
runtime/fuse_linears.py) and `specdec::argmax_finite` (each row's argmax and whether every logit is finite, in one
read of a pass's logits; `argmax_finite` below).

`row_invariant(linear=...)` is a `TorchFunctionMode` that routes those calls, made by a Hugging Face model inside it,
to the kernels: no model file is forked and nothing is written on a model's config. The fast path enters it in its
passes, where `torch.compile` traces through it and keeps each kernel as one opaque call. Calls a kernel cannot
serve (dropout, `is_causal` without a mask, float64, another device) go to PyTorch unchanged.

The kernels are compiled once per machine for its instruction-set tier (`kernel_tier`: avx512_amx, avx512_bf16,
avx512, avx2_vnni, avx2, neon_dotprod, neon or generic, from the CPU's features; `SPECDEC_KERNEL_TIER` picks a lower
one) with `torch.utils.cpp_extension`, and cached under `~/.cache/torch_extensions` (`TORCH_EXTENSIONS_DIR`) in a
directory named after everything that changes the build (`build_name`: the tier, the sources' bytes and paths, the
flags, torch's version and headers, the ninja on PATH that runs it), so two environments or checkouts on one machine
never rebuild each other's copy. `make install` builds them (`python -m specdec.runtime.rowwise`); otherwise the
first use does. It needs the C++ compiler inductor needs anyway, and `ninja` (a dependency of specdec).

Concurrent builds of one name wait for each other on an advisory lock the OS drops when its holder exits
(`build_lock`), so a build killed half-way (a timeout, Ctrl-C) cannot leave `torch.utils.cpp_extension`'s own lock
file behind for every later process to wait on forever.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import logging
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from specdec.errors import ConfigError
from specdec.runtime import cpuinfo

log = logging.getLogger("specdec.fastpath")

KERNELS = Path(__file__).resolve().parent / "kernels"
SOURCES = [KERNELS / name for name in ("row_attention.cpp", "row_linear.cpp", "packed_linear.cpp", "row_argmax.cpp")]
#: Headers the sources include: their bytes are part of the build's name too.
HEADERS = [KERNELS / "simd.h", KERNELS / "packed_core.h"]

_AVX512 = ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mfma", "-mf16c", "-DCPU_CAPABILITY=AVX512",
           "-DCPU_CAPABILITY_AVX512"]
#: Instruction-set tier -> compiler flags (ATen's vector types follow CPU_CAPABILITY), most capable first per
#: architecture. kernels/simd.h says what each tier computes with.
TIER_FLAGS = {
    "avx512_amx": [*_AVX512, "-mavx512bf16", "-mavx512vnni", "-mamx-tile", "-mamx-bf16"],
    "avx512_bf16": [*_AVX512, "-mavx512bf16", "-mavx512vnni"],
    "avx512": _AVX512,
    "avx2_vnni": ["-mavx2", "-mfma", "-mf16c", "-mavxvnni", "-DCPU_CAPABILITY=AVX2", "-DCPU_CAPABILITY_AVX2"],
    "avx2": ["-mavx2", "-mfma", "-mf16c", "-DCPU_CAPABILITY=AVX2", "-DCPU_CAPABILITY_AVX2"],
    "neon_dotprod": ["-march=armv8.2-a+dotprod"],  # aarch64 with the int8 dot product (sdot)
    "neon": [],  # aarch64: Advanced SIMD is the baseline
    "generic": [],
}
#: The CPU flags (/proc/cpuinfo) each x86 tier needs.
_X86_NEEDS = {
    "avx512_amx": {"avx512f", "avx512bw", "avx512vl", "avx512dq", "fma", "f16c", "avx512_bf16", "avx512_vnni",
                   "amx_tile", "amx_bf16"},
    "avx512_bf16": {"avx512f", "avx512bw", "avx512vl", "avx512dq", "fma", "f16c", "avx512_bf16", "avx512_vnni"},
    "avx512": {"avx512f", "avx512bw", "avx512vl", "avx512dq", "fma", "f16c"},
    "avx2_vnni": {"avx2", "fma", "f16c", "avx_vnni"},
    "avx2": {"avx2", "fma", "f16c"},
}
#: The same for the aarch64 tiers (/proc/cpuinfo's `Features`; Advanced SIMD is the baseline).
_ARM_NEEDS = {
    "neon_dotprod": {"asimddp"},
    "neon": set(),
}

#: What the kernels compute in (float32 arithmetic); float64 stays with PyTorch's kernels.
DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@functools.cache
def cpu_tiers() -> tuple[str, ...]:
    """The kernel tiers this CPU runs, most capable first (always ending with "generic")."""
    machine = platform.machine().lower()
    if machine in ("aarch64", "arm64"):
        return (*(tier for tier, needs in _ARM_NEEDS.items() if needs <= cpuinfo.flags()), "generic")
    if machine not in ("x86_64", "amd64", "i686", "x86"):
        return ("generic",)
    features = cpuinfo.flags()
    if features:
        tiers = [tier for tier, needs in _X86_NEEDS.items()
                 if needs <= features and (tier != "avx512_amx" or cpuinfo.amx_tiles_granted())]
    else:  # no /proc/cpuinfo (macOS, Windows): what PyTorch's own dispatch found
        capability = torch.backends.cpu.get_cpu_capability()
        tiers = ["avx512", "avx2"] if capability == "AVX512" else ["avx2"] if capability == "AVX2" else []
    return (*tiers, "generic")


@functools.cache
def kernel_tier() -> str:
    """The tier the kernels are built for here: the CPU's best, or `SPECDEC_KERNEL_TIER` (one this CPU runs)."""
    tiers = cpu_tiers()
    wanted = os.environ.get("SPECDEC_KERNEL_TIER", "").strip().lower()
    if not wanted:
        return tiers[0]
    if wanted not in tiers:
        raise ConfigError(f"SPECDEC_KERNEL_TIER={wanted!r} is not a tier this CPU runs; choose one of "
                          f"{', '.join(tiers)} (or unset it for {tiers[0]})")
    return wanted


def openmp_flags() -> list[str]:
    """The flags that make the kernels' `at::parallel_for` run on torch's threads: `-fopenmp` where torch's own
    parallel backend is OpenMP and the compiler is GCC or clang on Linux. Without it the inlined `parallel_for`
    compiles to one serial loop, and every kernel runs on one core whatever `torch.set_num_threads` says. The
    extension then uses the OpenMP runtime torch has already loaded (the same `libgomp.so.1`), so one thread pool
    serves both. Elsewhere (macOS's compiler has no `-fopenmp`) the kernels run on one thread."""
    return ["-fopenmp"] if sys.platform == "linux" and torch.backends.openmp.is_available() else []


def build_flags(tier: str) -> list[str]:
    return ["-O3", "-ffp-contract=off", *openmp_flags(), *TIER_FLAGS[tier]]


@functools.cache
def kernels_version(tier: str) -> str:
    """What the kernels compute for `tier`: a hash of their sources' and headers' bytes, the flags, torch's version and
    include directories. What depends on the kernels and not on where they were built is keyed on it: compiled
    graphs (`FuseRowLinears.uuid`) and the precision measured on this machine (`precision.machine_key`)."""
    from torch.utils.cpp_extension import include_paths  # noqa: PLC0415 (heavy)

    digest = hashlib.sha256()
    for path in (*SOURCES, *HEADERS):
        digest.update(path.name.encode() + path.read_bytes())
    digest.update(" ".join([*build_flags(tier), torch.__version__, *include_paths()]).encode())
    return digest.hexdigest()[:16]


@functools.cache
def ninja_version() -> str:
    """The version of the `ninja` that torch's build runs (the first on PATH), or "" where none runs."""
    try:
        return subprocess.run(["ninja", "--version"], capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return ""


@functools.cache
def build_name(tier: str) -> str:
    """The kernels' library and build directory name for `tier`: their version, where their sources are and the ninja
    that builds them, so a build is reused exactly when it would be rebuilt the same. Where matters: torch's build
    names each source by its path, so two checkouts or installs of the same sources sharing one build would rebuild it
    whenever a process of the other one loaded it. The ninja matters the same way: one ninja does not read another
    version's build log and rebuilds everything, so an activated environment (its pip-installed ninja first on PATH)
    and a plain shell (the system's) rebuilt each other's kernels at every switch (26-28 s a time on a Zen 4 core)."""
    digest = hashlib.sha256(kernels_version(tier).encode())
    for path in (*SOURCES, *HEADERS):
        digest.update(str(path.resolve()).encode())
    digest.update(ninja_version().encode())
    return f"specdec_kernels_{tier}_{digest.hexdigest()[:16]}"


def build_directory(name: str) -> Path:
    """Where the kernels named `name` are built and cached: `TORCH_EXTENSIONS_DIR`, else torch's default root."""
    from torch.utils.cpp_extension import get_default_build_root  # noqa: PLC0415 (heavy)

    return Path(os.environ.get("TORCH_EXTENSIONS_DIR") or get_default_build_root()) / name


@contextlib.contextmanager
def build_lock(directory: Path):
    """Hold `directory`'s build lock: an advisory `flock` that the OS releases when its holder exits, however it
    exits. Every build of the kernels takes it before `torch.utils.cpp_extension.load`, so a `lock` file that load
    left in `directory` while no process holds this one was left by a build that died, and is removed."""
    import fcntl  # noqa: PLC0415 (POSIX only, like the kernels' build)

    directory.mkdir(parents=True, exist_ok=True)
    with open(directory / "specdec-build.lock", "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            stale = directory / "lock"
            if stale.exists():
                log.warning("removed %s, left by a kernel build that did not finish", stale)
                stale.unlink()
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


@functools.cache
def load_kernel() -> None:
    """Build (first use on this machine) or load the kernels and register their shape functions."""
    from torch.utils.cpp_extension import load  # noqa: PLC0415 (heavy; only the fast path needs it)

    tier = kernel_tier()
    name = build_name(tier)
    directory = build_directory(name)
    start = time.perf_counter()
    with build_lock(directory):
        load(name=name, sources=[str(s) for s in SOURCES], extra_cflags=build_flags(tier),
             extra_ldflags=openmp_flags(), build_directory=str(directory), is_python_module=False)
    elapsed = time.perf_counter() - start
    if elapsed > 1.0:
        log.info("built the row-invariant kernels (%s) in %.1f s", name, elapsed)

    @torch.library.register_fake("specdec::row_attention")
    def _(q, k, v, mask, scale):  # [B, H, M, D], as q
        return torch.empty(q.shape, dtype=q.dtype, device=q.device)

    @torch.library.register_fake("specdec::row_linear")
    def _(x, weight, bias):  # [..., N]
        return torch.empty((*x.shape[:-1], weight.shape[0]), dtype=x.dtype, device=x.device)

    @torch.library.register_fake("specdec::packed_linear")
    def _(x, packed, bias, n):  # [..., N]
        return torch.empty((*x.shape[:-1], n), dtype=x.dtype, device=x.device)

    @torch.library.register_fake("specdec::argmax_finite")
    def _(logits):  # [...] int64, [] bool
        return (torch.empty(logits.shape[:-1], dtype=torch.long, device=logits.device),
                torch.empty((), dtype=torch.bool, device=logits.device))


def packed_linear_serves(weight: torch.Tensor) -> bool:
    """Whether `specdec::packed_linear` (kernels/packed_linear.cpp) runs with this weight: a 2-D CPU weight in
    float32 or bfloat16 (every tier packs both)."""
    return weight.device.type == "cpu" and weight.dim() == 2 and weight.dtype in (torch.float32, torch.bfloat16)


def _ensure_loaded() -> None:
    if not torch.compiler.is_compiling():  # a compiled pass is traced after an eager one loaded them
        load_kernel()


def row_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attn_mask: torch.Tensor | None = None,
                  scale: float | None = None) -> torch.Tensor:
    """softmax(scale · query keyᵀ + attn_mask) value, each query row on its own. query [B, H, M, D]; key, value
    [B, Hkv, L, D] (H a multiple of Hkv); attn_mask additive [B|1, H|1, M, L] or boolean (True = attend)."""
    _ensure_loaded()
    scale = query.shape[-1] ** -0.5 if scale is None else scale
    return torch.ops.specdec.row_attention(query, key, value, attn_mask, float(scale))


def kernel_threads() -> int:
    """How many threads the kernels split a call among at torch's current thread count (1 where they were built
    without OpenMP: `openmp_flags`)."""
    load_kernel()
    return int(torch.ops.specdec.parallel_threads())


def argmax_finite(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(logits.argmax(-1), torch.isfinite(logits).all()) for logits [..., V]: on CPU float32, bfloat16 and float16
    in one read (`specdec::argmax_finite`, kernels/row_argmax.cpp), elsewhere by PyTorch's two reductions. The
    indices are unspecified where `finite` is false."""
    if logits.device.type == "cpu" and logits.dtype in DTYPES:
        _ensure_loaded()
        return torch.ops.specdec.argmax_finite(logits)
    return logits.argmax(dim=-1), torch.isfinite(logits).all()


def kernel_loaded() -> bool:
    """Whether this process has loaded the kernels (the fast path, or a row-invariant eager pass, did)."""
    return load_kernel.cache_info().currsize > 0


#: The CPU flags that make inductor probe a vector ISA before its first compile (a test build with that ISA's flags
#: and a child process that loads it), each with the kernels' build flags that prove that build (-mavx512f implies
#: -mavx2).
_INDUCTOR_PROBES = {"avx2": ("-mavx2", "-mavx512f"), "avx512f": ("-mavx512f",), "avx512_vnni": ("-mavx512vnni",),
                    "amx_tile": ("-mamx-tile",)}


def vector_isa_proven() -> bool:
    """Whether this process's own kernels have already shown what inductor's vector-ISA probe would: that the C++
    compiler builds, and this process loads, code for every ISA inductor probes on this CPU (an x86 CPU, whose
    kernels are built with each of those ISAs' flags: its best tier, not a lower one picked by
    `SPECDEC_KERNEL_TIER`). The fast path then tells inductor to skip the probe (`compiled.Compiled.options`), and
    inductor picks the ISA the probe would have. On one Zen 4 core its ISA list took 6.8 s on a cold cache and 1.0 s
    in every later process, 1.2 and 0.16 s so (it still checks a VNNI and a bfloat16 instruction of its own). Builds
    and loads the kernels (every compiled pass on a CPU does)."""
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return False
    load_kernel()
    built = TIER_FLAGS[kernel_tier()]
    return all(any(flag in built for flag in proof) for cpu_flag, proof in _INDUCTOR_PROBES.items()
               if cpu_flag in cpuinfo.flags())


def _reads_once(logits: torch.Tensor) -> bool:
    """Does `argmax_finite`'s kernel serve these logits without building or loading anything: CPU float32,
    bfloat16 or float16, with the kernels already loaded (a float32 eager path that never used them, or a machine
    that cannot build them, keeps PyTorch's reductions)."""
    return logits.device.type == "cpu" and logits.dtype in DTYPES and kernel_loaded()


def argmax(logits: torch.Tensor) -> torch.Tensor:
    """logits.argmax(-1) for logits [..., V]: by `argmax_finite`'s one read where it serves (`_reads_once`;
    PyTorch's reduction took 525 µs on [32, 8192] float32 on one core of the Xeon model 207, the kernel 25 µs),
    PyTorch's where a value is not finite (the kernel's indices are unspecified there) and elsewhere."""
    if not _reads_once(logits):
        return logits.argmax(dim=-1)
    best, finite = argmax_finite(logits)
    return best if bool(finite) else logits.argmax(dim=-1)


def all_finite(logits: torch.Tensor) -> bool:
    """bool(torch.isfinite(logits).all()): by `argmax_finite`'s one read where it serves (`_reads_once`; 2.35 ms
    against 0.14 ms on [32, 3, 8192] float32 on one core of the Xeon model 207), PyTorch's elsewhere."""
    if not _reads_once(logits):
        return bool(torch.isfinite(logits).all())
    return bool(argmax_finite(logits)[1])


def row_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x weightᵀ + bias, each output element in one fixed reduction order. x [..., K], weight [N, K] -> [..., N]."""
    _ensure_loaded()
    return torch.ops.specdec.row_linear(x, weight, bias)


class row_invariant(TorchFunctionMode):  # noqa: N801 (used as a context manager, like torch's modes)
    """Inside this context, `F.scaled_dot_product_attention` (and with linear=True, `F.linear`) on CPU tensors of
    float32, bfloat16 or float16 run the row-invariant kernels."""

    def __init__(self, linear: bool = False):
        super().__init__()
        self.linear = linear

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.scaled_dot_product_attention:
            served = _attention_args(*args, **kwargs)
            if served is not None:
                return row_attention(*served)
        elif func is F.linear and self.linear and _linear_served(*args, **kwargs):
            return row_linear(*args, **kwargs)
        return func(*args, **kwargs)


def _attention_args(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
    """(query, key, value, attn_mask, scale) when row_attention computes this call exactly, else None."""
    if dropout_p or is_causal or query.device.type != "cpu" or query.dim() != 4:
        return None
    if query.dtype not in DTYPES or key.dtype != query.dtype or value.dtype != query.dtype:
        return None
    if query.shape[1] % key.shape[1]:
        return None
    return query, key, value, attn_mask, scale


def _linear_served(input, weight, bias=None) -> bool:
    return (input.device.type == "cpu" and input.dtype in DTYPES and weight.dtype == input.dtype
            and weight.dim() == 2 and (bias is None or bias.dtype == input.dtype))


def main() -> None:
    """`python -m specdec.runtime.rowwise`: build (or find) this machine's kernels and say which tier they are."""
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    start = time.perf_counter()
    load_kernel()
    print(f"specdec kernels: tier {kernel_tier()} (this CPU runs {', '.join(cpu_tiers())}), "
          f"{build_name(kernel_tier())}, ready in {time.perf_counter() - start:.1f} s")


if __name__ == "__main__":
    main()
