"""The default target's GEMM shapes at M = 1, 4 and 7 rows (one-token pass, γ = 3 and γ = 6 verification
passes), one thread, `torch.nn.functional.linear` (what the compiled pass calls as aten::mm): how much dearer
the skinny M-row product is than the one-row one. Medians of 200 calls.

    flock /tmp/specdec-bench.lock python benchmarks/skinny_gemm.py
"""

import argparse

import torch

from specdec.bench import timing


def median_ms(fn, repeats: int = 200) -> float:
    return timing.median_ms(fn, repeats, warmup=10)


def main() -> None:
    argparse.ArgumentParser(description=__doc__.splitlines()[0]).parse_args()
    torch.set_num_threads(1)
    # (in, out): attention projections, MLP up/gate, MLP down, LM head (d = 384, ffn 1024, V = 8192)
    for k, n in ((384, 384), (384, 1024), (1024, 384), (384, 8192)):
        weight = torch.randn(n, k)
        row = []
        for m in (1, 4, 7):
            x = torch.randn(m, k)
            row.append(f"M={m} {median_ms(lambda: torch.nn.functional.linear(x, weight)):.3f} ms")
        print(f"{k}x{n}: " + ", ".join(row))


if __name__ == "__main__":
    main()
