"""The largest number of rows n that MDA and SMEA accept at their default ``max_subsets``, for
each f: docs/robust-aggregation.md's table, from the rules' own ``check(n)`` (both enumerate
C(n, f) subsets and refuse n past their bound; f < n/2 besides). ``-`` where no n is
accepted (every n > 2f already has more than ``max_subsets`` subsets).

    python benchmarks/subset_limits.py
"""

from __future__ import annotations

from strategies.aggregators import MinimumDiameterAveraging, SmallestMaxEigenvalueAveraging

FS = (1, 2, 3, 4, 5, 6, 8, 10)


def accepts(rule: object, n: int) -> bool:
    try:
        rule.check(n)  # type: ignore[attr-defined]
    except ValueError:
        return False
    return True


def largest_n(rule: object, f: int) -> int | None:
    """The largest n the rule accepts (None: none): C(n, f) grows with n past 2f, so the
    accepted n are one interval starting at 2f + 1, found by doubling then bisection."""
    lo = 2 * f + 1
    if not accepts(rule, lo):
        return None
    hi = lo
    while accepts(rule, hi * 2):
        hi *= 2
    hi *= 2  # not accepted
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if accepts(rule, mid) else (lo, mid)
    return lo


def main() -> None:
    print("| f | " + " | ".join(str(f) for f in FS) + " |")
    print("|---|" + "---|" * len(FS))
    for name, cls in (("MDA", MinimumDiameterAveraging), ("SMEA", SmallestMaxEigenvalueAveraging)):
        cells = [largest_n(cls(f=f), f) for f in FS]
        print(f"| {name} | " + " | ".join("-" if n is None else f"{n:,}" for n in cells) + " |")


if __name__ == "__main__":
    main()
