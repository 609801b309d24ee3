"""Each aggregation rule against ByzFL's counterpart, measured in the same run.

n = 100 rows, f = 10, d = 1,000,000 float32 by default (``--d`` to change). Both sides get the
same torch tensor (ByzFL accepts torch) and the same parameters; a rule ByzFL lacks is compared
with what a ByzFL user would compose (Bulyan = iterated ByzFL Krum + coordinate-wise trimming).
The minimum of ``--repeat`` runs is reported, and the ratio fedray / ByzFL. MDA and SMEA
enumerate C(n, f) subsets and are not run at this size (their ``check`` rejects it).

Run: ``python benchmarks/aggregators.py [--d 1000000] [--repeat 3]`` (``make bench``).
"""

from __future__ import annotations

import argparse
import math
import platform
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks import peers
from strategies import aggregators as A
from strategies import meta as M
from strategies import preaggregators as P


def timed(fn, x, repeat):
    best = math.inf
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn(x)
        best = min(best, time.perf_counter() - t0)
    return best


def byzfl_bulyan(b, f):
    """Bulyan from ByzFL parts: theta = n - 2f rows by iterated ByzFL Krum, then the
    beta = theta - 2f values closest to the median per coordinate (ByzFL's Meamed)."""
    def run(x):
        rest = x.clone()
        chosen = []
        for _ in range(x.shape[0] - 2 * f):
            k = b.Krum(f=f)(rest)
            i = int(torch.nonzero((rest == k).all(dim=1))[0])
            chosen.append(rest[i])
            rest = torch.cat([rest[:i], rest[i + 1 :]])
        sel = torch.stack(chosen)
        return b.Meamed(f=2 * f)(sel)
    return run


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=100)
    ap.add_argument("--f", type=int, default=10)
    ap.add_argument("--d", type=int, default=1_000_000)
    ap.add_argument("--repeat", type=int, default=3)
    a = ap.parse_args()
    n, f, d = a.n, a.f, a.d
    g = torch.Generator().manual_seed(0)
    x = torch.randn((n, d), generator=g)
    x[n - f :] = x[n - f :] * 5 + 1  # f outlying rows
    gen = torch.Generator().manual_seed(1)
    with peers.byzfl() as b:
        cases = [
            ("mean", A.Mean(), b.Average()),
            ("median", A.CoordinateWiseMedian(), b.Median()),
            ("cwtm", A.CoordinateWiseTrimmedMean(f), b.TrMean(f=f)),
            ("meamed", A.MeaMed(f), b.Meamed(f=f)),
            ("geomed (3 iterations)", A.GeometricMedian(nu=0.1, iterations=3, tol=0.0, init="zero"),
             b.GeometricMedian(nu=0.1, T=3)),
            ("krum", A.Krum(f), b.Krum(f=f)),
            ("multikrum", A.MultiKrum(f), b.MultiKrum(f=f)),
            ("bulyan", A.Bulyan(f), byzfl_bulyan(b, f)),
            ("monna", A.MoNNA(f), b.MoNNA(f=f)),
            ("cc (tau=1, 3 iterations)", A.CenteredClipping(1.0, 3), b.CenteredClipping(L=3, tau=1.0)),
            ("caf (exact; ByzFL: 1 power step)", A.CovarianceAgnosticFilter(f), b.CAF(f=f)),
            ("nnm", P.NearestNeighborMixing(f), b.NNM(f=f)),
            ("arc", P.AdaptiveRobustClipping(f), b.ARC(f=f)),
            ("clipping", P.StaticClipping(1.0), b.Clipping(c=1.0)),
            ("bucketing (s=2)", lambda v: P.Bucketing(2)(v, gen), b.Bucketing(s=2)),
        ]
        extra = [
            ("dnc", lambda v: A.DivideAndConquer(f)(v, gen)),
            ("ctma over median", lambda v: M.CenteredTrimmedMetaAggregator(f)(v, A.CoordinateWiseMedian())),
        ]
        print(f"n = {n}, f = {f}, d = {d:,} float32; torch {torch.__version__}, "
              f"{torch.get_num_threads()} threads, {platform.processor() or platform.machine()}")
        print(f"{'rule':36s} {'fedray s':>10s} {'ByzFL s':>10s} {'ratio':>7s}")
        for name, ours, theirs in cases:
            t_ours = timed(ours, x, a.repeat)
            # ByzFL's clipping rules write into their argument: they get a copy (timed), which
            # is what using them safely costs
            try:
                copy = name in ("arc", "clipping")
                t_theirs = timed(lambda v, t=theirs, c=copy: t(v.clone() if c else v),
                                 x, 1 if name == "bulyan" else a.repeat)
            except (RuntimeError, MemoryError) as e:  # ByzFL's NNM gathers an (n, n-f, d) copy
                print(f"{name:36s} {t_ours:10.3f} {'failed':>10s} {'-':>7s}  ByzFL: {str(e)[:60]}")
                continue
            print(f"{name:36s} {t_ours:10.3f} {t_theirs:10.3f} {t_ours / t_theirs:7.2f}")
        for name, ours in extra:
            print(f"{name:36s} {timed(ours, x, a.repeat):10.3f} {'-':>10s} {'-':>7s}")
        for rule in (A.MinimumDiameterAveraging(f), A.SmallestMaxEigenvalueAveraging(f)):
            try:
                rule.check(n)
            except ValueError as e:
                print(f"{type(rule).__name__}: {e}")


if __name__ == "__main__":
    main()
