"""Two variants of the packed kernel (kernels/packed_core.h) in one process, their passes alternated: the A/B for a
change of blocking or prefetching on a machine whose speed moves between runs (a shared guest), where two builds
timed in runs of their own cannot be told apart.

    python benchmarks/kernel_ab.py --a 'R_DOT8 = 3, R_DOT4 = 2, ACC_DOT = 24=>R_DOT8 = 8, R_DOT4 = 8, ACC_DOT = 32' \\
        --bits 8 --rows 1,4,8,128

Each variant is packed_core.h as it is, with --a's (and --b's) substitutions (OLD=>NEW, exact text, each must
match); they are compiled side by side (namespaces kernel_a and kernel_b) with the tier's flags into one program
(kernel_ab.cpp), which packs every linear of a ladder shape once in W8A8, W4A8 or BF16_PAIRS, with --weight-only
in INT8, INT4 or BF16 weights on float32 inputs, or with --bits 32 in F32 (the layout does not depend on the
blocking), then times passes over all of them, A and B in turn, for --repeats rounds: per width, each side's median
pass time and GB/s, and B / A. Random weights and inputs; one thread. Nothing here checks bits: the kernel tests
do (tests/test_kernel_tiers.py).
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the sibling scripts below

from linears_pass import linears  # noqa: E402
from size_ladder import SHAPES  # noqa: E402
from specdec.runtime import rowwise  # noqa: E402


def variant(name: str, substitutions: list[str], header: Path | None = None) -> str:
    """packed_core.h (or `header`, an edited copy of it) with its namespace renamed to specdec::NAME and each OLD=>NEW
    applied."""
    text = (header or rowwise.KERNELS / "packed_core.h").read_text()
    text = text.replace("namespace specdec::packed", f"namespace specdec::{name}")
    for sub in substitutions:
        old, sep, new = sub.partition("=>")
        if not sep or old not in text:
            raise SystemExit(f"kernel_ab: {sub!r} is not OLD=>NEW with OLD in packed_core.h")
        text = text.replace(old, new)
    return text


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--a", action="append", default=[], metavar="OLD=>NEW", help="variant A's substitution")
    parser.add_argument("--b", action="append", default=[], metavar="OLD=>NEW", help="variant B's substitution")
    parser.add_argument("--a-header", type=Path, default=None, metavar="PATH",
                        help="variant A from this edited copy of packed_core.h (two edits against each other)")
    parser.add_argument("--b-header", type=Path, default=None, metavar="PATH",
                        help="variant B from this edited copy of packed_core.h (a change too large for --b)")
    parser.add_argument("--shape", default="qwen2.5-0.5b", choices=sorted(SHAPES))
    parser.add_argument("--bits", type=int, choices=(8, 4, 16, 32), default=8,
                        help="8: W8A8, 4: W4A8, 16: BF16_PAIRS on bfloat16 inputs (every linear); 32: F32 weights "
                             "on float32 inputs")
    parser.add_argument("--weight-only", action="store_true",
                        help="--bits 8 / 4 / 16 as INT8 / INT4 / BF16 weights on float32 inputs instead")
    parser.add_argument("--bf16-rows", action="store_true",
                        help="with --weight-only --bits 4 or 8: INT4 / INT8 in a bfloat16 pass (the rows as "
                             "bfloat16 too)")
    parser.add_argument("--rows", default="1,4,8,128")
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--tier", default=None, help="a tier this CPU runs (default: the kernels' tier here)")
    args = parser.parse_args()
    tier = args.tier or rowwise.kernel_tier()
    if tier not in rowwise.cpu_tiers():
        raise SystemExit(f"kernel_ab: this CPU does not run {tier} (it runs {', '.join(rowwise.cpu_tiers())})")
    if args.bits == 16 and not args.weight_only and tier not in ("avx512_bf16", "avx512_amx"):
        raise SystemExit(f"kernel_ab: --bits 16 (BF16_PAIRS by AVX512_BF16's dot product) needs the avx512_bf16 tier, "
                         f"not {tier}")
    compiler = shutil.which("c++") or shutil.which("g++")
    if compiler is None:
        raise SystemExit("kernel_ab: needs a C++ compiler (c++ or g++)")
    with tempfile.TemporaryDirectory() as scratch:
        folder = Path(scratch)
        (folder / "kernel_a.h").write_text(variant("kernel_a", args.a, args.a_header))
        (folder / "kernel_b.h").write_text(variant("kernel_b", args.b, args.b_header))
        binary = folder / "kernel_ab"
        subprocess.run([compiler, "-std=c++17", "-O3", "-ffp-contract=off", *rowwise.TIER_FLAGS[tier],
                        f"-I{folder}", f"-I{rowwise.KERNELS}", str(Path(__file__).with_suffix(".cpp")), "-o",
                        str(binary)], check=True)
        shapes = [str(v) for pair in linears(args.shape) for v in pair]
        formats = ({8: "INT8", 4: "INT4", 16: "BF16"} if args.weight_only else
                   {8: "W8A8", 4: "W4A8", 16: "BF16_PAIRS"}) | {32: "F32"}
        fmt = formats[args.bits] + ("_BF16" if args.bf16_rows else "")
        if args.bf16_rows and fmt not in ("INT4_BF16", "INT8_BF16"):
            raise SystemExit("kernel_ab: --bf16-rows is for --weight-only --bits 4 or 8")
        print(f"{args.shape}, {fmt}, tier {tier}, one thread; "
              f"A: {args.a or 'as is'}{f' on {args.a_header}' if args.a_header else ''}; "
              f"B: {args.b or 'as is'}{f' on {args.b_header}' if args.b_header else ''}")
        for rows in args.rows.split(","):
            out = subprocess.run([str(binary), rows, str(args.repeats), fmt, *shapes], check=True,
                                 capture_output=True, text=True).stdout.split("\n")
            print(f"{rows:>4} rows  " + "  ".join(line for line in out if line))


if __name__ == "__main__":
    main()
