"""The packed kernel on every instruction-set tier, from any machine (kernels/test/packed_test.cpp).

Each tier's test program is built with that tier's flags and run where this machine can run it: the x86 tiers on a
CPU with their features, the aarch64 tier with a cross compiler under qemu-aarch64 (Debian: g++-aarch64-linux-gnu,
qemu-user; `.ci/run` installs them), the generic tier anywhere. A tier that cannot be built or run here is skipped
with the reason, so CI's summary names every tier it did not check. The program checks every format's bits against
the scalar reference at passes of 1 to 33 rows, odd sizes and split panel ranges; see its header.
"""

from __future__ import annotations

import os
import platform
import re
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from specdec.runtime.rowwise import KERNELS, TIER_FLAGS, cpu_tiers

SOURCE = KERNELS / "test" / "packed_test.cpp"
X86 = platform.machine().lower() in ("x86_64", "amd64")
ARM = platform.machine().lower() in ("aarch64", "arm64")
#: Flags the tier programs are built with: the tier's own, minus ATen's defines (the program has no ATen).
BASE = ["-std=c++17", "-O2", "-ffp-contract=off"]


def _isa_flags(tier: str) -> list[str]:
    return [f for f in TIER_FLAGS[tier] if not f.startswith("-D")]


def _toolchain(tier: str) -> tuple[list[str], list[str]]:
    """(compile command prefix, run prefix) for `tier` here, or pytest.skip naming what is missing."""
    if tier.startswith("neon"):
        if ARM:
            return [shutil.which("c++") or "c++"], []
        cross, qemu = shutil.which("aarch64-linux-gnu-g++"), shutil.which("qemu-aarch64")
        if not cross or not qemu:
            pytest.skip(f"{tier}: needs aarch64-linux-gnu-g++ and qemu-aarch64 (apt install g++-aarch64-linux-gnu "
                        "qemu-user) on a non-Arm machine")
        return [cross, "-static"], [qemu]
    compiler = shutil.which("c++") or shutil.which("g++")
    if not compiler:
        pytest.skip("no C++ compiler")
    if tier != "generic" and not X86:
        pytest.skip(f"{tier}: an x86 tier, this machine is {platform.machine()}")
    return [compiler], []


@pytest.fixture(scope="module")
def assembly(tmp_path_factory) -> Callable[[str], Path]:
    """assembly(tier): the tier's program compiled to assembly with the tier's flags, once a module (skipped where
    `_toolchain` skips). The bits test assembles, links and runs it; the prefetch test reads it. The compile is most
    of each test's time: 10-20 s a tier on a 2-core machine."""
    directory, built = tmp_path_factory.mktemp("tiers"), {}

    def compiled(tier: str) -> Path:
        compile_cmd, _ = _toolchain(tier)
        if tier not in built:
            path = directory / f"packed_test_{tier}.s"
            ran = subprocess.run([*compile_cmd, *BASE, *_isa_flags(tier), "-S", str(SOURCE), "-o", str(path)],
                                 capture_output=True, text=True, timeout=600)
            assert ran.returncode == 0, f"{tier} does not build:\n{ran.stderr[-3000:]}"
            built[tier] = path
        return built[tier]

    return compiled


@pytest.mark.parametrize("tier", list(TIER_FLAGS))
def test_packed_kernel_bits_on_each_tier(tier, assembly, tmp_path: Path):
    compile_cmd, run_prefix = _toolchain(tier)
    binary = tmp_path / f"packed_test_{tier}"
    built = subprocess.run([*compile_cmd, str(assembly(tier)), "-o", str(binary)],
                           capture_output=True, text=True, timeout=600)
    assert built.returncode == 0, f"{tier} does not assemble and link:\n{built.stderr[-3000:]}"
    if tier not in cpu_tiers() and not (tier.startswith("neon") and run_prefix):  # qemu-aarch64 emulates both
        pytest.skip(f"{tier}: built; this CPU cannot run it (it runs {', '.join(cpu_tiers())})")
    ran = subprocess.run([*run_prefix, str(binary)], capture_output=True, text=True, timeout=600)
    assert ran.returncode == 0 and ran.stdout.startswith(f"ok {tier} "), ran.stdout[-3000:] + ran.stderr[-1000:]


@pytest.mark.compile  # builds the whole library per tier (a minute or two each)
@pytest.mark.parametrize("tier", [t for t in TIER_FLAGS if t != cpu_tiers()[0]])
def test_row_kernels_on_each_lower_tier(tier):
    """The whole kernel library (attention, linear, argmax with their ATen bindings) built for each tier below this
    CPU's best, and tests/test_rowwise.py run against it in a child process (SPECDEC_KERNEL_TIER): the bits
    against references, row invariance, masks and odd sizes, on every tier this machine can execute."""
    if tier not in cpu_tiers():
        pytest.skip(f"{tier}: this CPU cannot run it (it runs {', '.join(cpu_tiers())})")
    env = {**os.environ, "SPECDEC_KERNEL_TIER": tier}
    try:  # a minute or two; the limit is under pytest-timeout's, so a child that hangs shows what it printed
        ran = subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider",
                              "-m", "not slow and not compile", str(Path(__file__).parent / "test_rowwise.py")],
                             env=env, capture_output=True, text=True, timeout=900)
    except subprocess.TimeoutExpired as hung:
        printed = [out.decode() if isinstance(out, bytes) else out or "" for out in (hung.stdout, hung.stderr)]
        pytest.fail(f"{tier}: tests/test_rowwise.py ran past 900 s:\n{printed[0][-3000:]}{printed[1][-2000:]}")
    assert ran.returncode == 0, ran.stdout[-4000:] + ran.stderr[-2000:]
    assert " passed" in ran.stdout.splitlines()[-1], ran.stdout[-500:]


def test_a_build_killed_half_way_leaves_no_lock_that_later_builds_wait_on(tmp_path: Path):
    """A build holds `build_lock` while torch's `load` keeps its own `lock` file in the build directory. Killed
    there, the build leaves that file; the next build waits only while the killed one lived, then removes it."""
    import threading  # noqa: PLC0415

    from specdec.runtime.rowwise import build_lock  # noqa: PLC0415

    directory = tmp_path / "specdec_kernels_generic_0"
    holder = subprocess.Popen(
        [sys.executable, "-c", "import sys, time; from pathlib import Path; from specdec.runtime.rowwise import "
         "build_lock\nd = Path(sys.argv[1])\nwith build_lock(d):\n    (d / 'lock').touch(); print('held', "
         "flush=True); time.sleep(600)", str(directory)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        entered = threading.Event()

        def build():
            with build_lock(directory):
                entered.set()

        waiter = threading.Thread(target=build, daemon=True)
        waiter.start()
        assert not entered.wait(0.5), "a second build went ahead while the first held the lock"
        assert (directory / "lock").exists(), "a live build's lock file was removed"
        holder.kill()  # the first build dies in the middle of torch's load
        assert entered.wait(30), "the next build still waits on a build that died"
        assert not (directory / "lock").exists()
    finally:
        holder.kill()
        holder.wait()


X86_CPUINFO = """processor\t: 0
vendor_id\t: AuthenticAMD
cpu family\t: 25
model\t\t: 1
model name\t: AMD EPYC 7B13
flags\t\t: fpu sse2 avx2 fma f16c

processor\t: 1
model name\t: another CPU
flags\t\t: fpu
"""
ARM_CPUINFO = """processor\t: 0
BogoMIPS\t: 243.75
Features\t: fp asimd bf16 i8mm
CPU implementer\t: 0x41
"""


def test_cpuinfo_reads_the_first_processor_s_name_generation_and_flags():
    from specdec.runtime.cpuinfo import parse  # noqa: PLC0415

    x86 = parse(X86_CPUINFO)
    assert (x86["model name"], x86["cpu family"], x86["model"]) == ("AMD EPYC 7B13", "25", "1")
    assert set(x86["flags"].split()) == {"fpu", "sse2", "avx2", "fma", "f16c"}
    arm = parse(ARM_CPUINFO)
    assert "model name" not in arm and set(arm["Features"].split()) == {"fp", "asimd", "bf16", "i8mm"}
    assert parse("") == {}


@pytest.mark.parametrize(("cpu", "features", "tiers"), [
    ("Graviton 1 (aarch64)", "fp asimd", ("neon", "generic")),
    ("Graviton 2 on (aarch64)", "fp asimd asimddp", ("neon_dotprod", "neon", "generic")),
    ("Zen 3", "avx2 fma f16c", ("avx2", "generic")),
    ("Intel client (Alder Lake on)", "avx2 fma f16c avx_vnni", ("avx2_vnni", "avx2", "generic")),
    ("Zen 4", "avx2 fma f16c avx512f avx512bw avx512vl avx512dq avx512_vnni avx512_bf16",
     ("avx512_bf16", "avx512", "avx2", "generic")),
    ("Xeon with AMX", "avx2 fma f16c avx_vnni avx512f avx512bw avx512vl avx512dq avx512_vnni avx512_bf16 amx_tile "
     "amx_bf16 amx_int8", ("avx512_amx", "avx512_bf16", "avx512", "avx2_vnni", "avx2", "generic")),
    ("Xeon with AMX, tiles refused by Linux", "avx2 fma f16c avx_vnni avx512f avx512bw avx512vl avx512dq avx512_vnni "
     "avx512_bf16 amx_tile amx_bf16 amx_int8 no-tiles", ("avx512_bf16", "avx512", "avx2_vnni", "avx2", "generic")),
    ("Skylake-X", "avx2 fma f16c avx512f avx512bw avx512vl avx512dq", ("avx512", "avx2", "generic")),
])
def test_tiers_follow_the_cpu_flags(cpu, features, tiers, monkeypatch):
    """Each tier where the CPU has all its features (AVX-VNNI, AVX512_VNNI, Arm's dot product: W4A8's int8 dot
    product; AMX's tiles where Linux also grants them to the process)."""
    from specdec.runtime import cpuinfo, rowwise  # noqa: PLC0415

    monkeypatch.setattr(platform, "machine", lambda: "aarch64" if "asimd" in features else "x86_64")
    monkeypatch.setattr(cpuinfo, "flags", lambda: set(features.split()) - {"no-tiles"})
    monkeypatch.setattr(cpuinfo, "amx_tiles_granted", lambda: "no-tiles" not in features)
    rowwise.cpu_tiers.cache_clear()
    try:
        assert rowwise.cpu_tiers() == tiers, cpu
    finally:
        rowwise.cpu_tiers.cache_clear()


@pytest.mark.parametrize(("cpu", "features", "tier", "proven"), [
    ("Zen 3", "avx2 fma f16c", "avx2", True),
    ("Intel client", "avx2 fma f16c avx_vnni", "avx2_vnni", True),
    ("Zen 4", "avx2 fma f16c avx512f avx512bw avx512vl avx512dq avx512_vnni avx512_bf16", "avx512_bf16", True),
    ("Zen 4, SPECDEC_KERNEL_TIER=avx2", "avx2 fma f16c avx512f avx512bw avx512vl avx512dq avx512_vnni avx512_bf16",
     "avx2", False),
    ("Xeon with AMX", "avx2 fma f16c avx512f avx512bw avx512vl avx512dq avx512_vnni avx512_bf16 amx_tile amx_bf16",
     "avx512_amx", True),
    ("Xeon with AMX, tiles refused by Linux", "avx2 fma f16c avx512f avx512bw avx512vl avx512dq avx512_vnni "
     "avx512_bf16 amx_tile amx_bf16", "avx512_bf16", False),  # inductor probes AMX, whose flags the build lacked
    ("Cascade Lake", "avx2 fma f16c avx512f avx512bw avx512vl avx512dq avx512_vnni", "avx512", False),
    ("Skylake-X", "avx2 fma f16c avx512f avx512bw avx512vl avx512dq", "avx512", True),
    ("Graviton 2 (aarch64)", "fp asimd asimddp", "neon_dotprod", False),
])
def test_inductors_isa_probe_is_skipped_only_where_the_kernels_build_proved_it(cpu, features, tier, proven,
                                                                               monkeypatch):
    """Inductor's probe builds and loads code for each vector ISA the CPU reports; the fast path skips it
    (`cpp.vec_isa_ok`) only where the kernels were built with every one of those ISAs' flags."""
    from specdec.runtime import cpuinfo, rowwise  # noqa: PLC0415

    monkeypatch.setattr(platform, "machine", lambda: "aarch64" if "asimd" in features else "x86_64")
    monkeypatch.setattr(cpuinfo, "flags", lambda: set(features.split()))
    monkeypatch.setattr(rowwise, "kernel_tier", lambda: tier)
    monkeypatch.setattr(rowwise, "load_kernel", lambda: None)
    assert rowwise.vector_isa_proven() is proven, cpu


#: The kernel's blocks of rows (packed_core.h), as their mangled names start, and where each tier has them.
#: (AMX's block, `amx_pairs`, streams without: its tile loads ran faster so.)
_BLOCKS = {"5BlockIL": "every", "10PairsBlockIL": "avx512_bf16", "8DotBlockIL": "every", "12ByteDotBlockIL": "every"}
#: The integer formats' blocks and the bfloat16 pairs' come in two kinds, by their `Prefetch` template argument
#: (mangled `Lb1E` or `Lb0E`): with and without a software prefetch, as the core's `DotStreaming` picks at run time;
#: on AVX-512 the other formats' blocks of a few rows too (`R_UNPREFETCHED`).
_DOT_PREFETCH = re.compile(r"(?:8DotBlock|12ByteDotBlock)ILi\d+ELi\d+ELb([01])E|10PairsBlockILi\d+ELb([01])E"
                           r"|5BlockILN\w+?FmtE\d+ELi\d+ELi\d+ELb([01])E")
#: The blocks that come in both kinds, and those that do on AVX-512 only.
_TWO_KINDS = ("8DotBlockIL", "12ByteDotBlockIL", "10PairsBlockIL")
_TWO_KINDS_AVX512 = ("5BlockIL",)


@pytest.mark.parametrize("tier", list(TIER_FLAGS))
def test_packed_kernel_blocks_prefetch_on_each_tier(tier, assembly):
    """Every block of the packed kernel, as compiled for each tier, prefetches the weights it streams, and the
    integer formats' and the pairs' blocks meant to stream without (`Prefetch` false, `_DOT_PREFETCH`) do not. A
    prefetch has no side effects, and GCC 12 deleted one reached through an always_inline function as dead code: the
    bfloat16 pairs' block built with no prefetch at all (simd.h's SPECDEC_PREFETCH). Built to assembly only, so every
    tier is checked on any machine with its compiler."""
    functions: dict[str, list[str]] = {}
    name = None
    for line in assembly(tier).read_text().splitlines():
        if line.startswith("_Z") and line.endswith(":"):
            name = line[:-1]
            functions[name] = []
        elif name is not None:
            functions[name].append(line.strip())
    prefetch = "prfm" if tier.startswith("neon") else "prefetch"
    for block, where in _BLOCKS.items():
        runs = {n: body for n, body in functions.items() if f"6detail{block}" in n and "3run" in n}
        if where != "every" and where != tier:
            assert not runs, f"{tier} has {block} blocks, only {where} should"
            continue
        assert runs, f"{tier}: no {block} block in the assembly"
        kinds = {n: _DOT_PREFETCH.search(n) for n in runs}
        kind = {n: None if k is None else next(g for g in k.groups() if g) for n, k in kinds.items()}
        if block in _TWO_KINDS or (block in _TWO_KINDS_AVX512 and tier.startswith("avx512")):
            assert set(kind.values()) == {"0", "1"}, f"{tier}: {block} lacks a prefetch kind"
            extra = [n for n, body in runs.items() if kind[n] == "0" and any(op.startswith(prefetch) for op in body)]
            assert not extra, f"{tier}: {len(extra)} unprefetched {block} blocks prefetch, e.g. {extra[0]}"
        missing = [n for n, body in runs.items() if not any(op.startswith(prefetch) for op in body)
                   and kind[n] in (None, "1")]
        assert not missing, f"{tier}: {len(missing)} of {len(runs)} {block} blocks never prefetch, e.g. {missing[0]}"
