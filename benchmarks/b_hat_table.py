"""The trimming parameter b_hat that each rule of strategies/subsampling.py tells the
aggregator, for the FedRo paper's n = 150, f = 30 and our scaled-down n = 30, f = 6.

    python benchmarks/b_hat_table.py          (the tables of docs/fedro.md)
"""

from __future__ import annotations

from strategies.subsampling import b_hat, hypergeometric_tail

SETTINGS = [(150, 30, [10, 15, 20, 30, 40, 50, 75, 100, 150]), (30, 6, [3, 4, 5, 6, 8, 10, 12, 16, 20, 30])]


def _b(n: int, f: int, s: int, rule: str, level: float) -> str:
    try:
        return str(b_hat(n, f, s, rule, level))
    except ValueError:
        return "-"


def main() -> None:
    for n, f, sizes in SETTINGS:
        print(f"n = {n}, f = {f}\n")
        print("| s | f s / n | exact, 0.05 | KL bound, 0.05 | exact, 0.01 | KL bound, 0.01 "
              "| P(B > ceil(s/2) - 1) |")
        print("|---:|---:|---:|---:|---:|---:|---:|")
        for s in sizes:
            tail = hypergeometric_tail(n, f, s, (s - 1) // 2)
            cells = [_b(n, f, s, r, lv) for lv in (0.05, 0.01) for r in ("hypergeometric", "kl")]
            print(f"| {s} | {f * s / n:.1f} | " + " | ".join(cells) + f" | {tail:.2g} |")
        print()


if __name__ == "__main__":
    main()
