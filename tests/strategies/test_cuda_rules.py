"""Every built-in aggregation rule on a CUDA device gives the CPU's numbers
(``runtime.server_device: cuda`` aggregates there). Skipped without a GPU: it runs where
one is lent (docs/performance.md says when it last ran)."""

from __future__ import annotations

import pytest
import torch

from strategies import aggregators as A
from strategies import meta as M
from strategies import preaggregators as P

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

N, D, F = 15, 3000, 3

# factories: a stateful rule (centered clipping) starts afresh on each device
RULES = {
    "mean": A.Mean, "median": A.CoordinateWiseMedian,
    "cwtm": lambda: A.CoordinateWiseTrimmedMean(F), "meamed": lambda: A.MeaMed(F),
    "geomed": A.GeometricMedian, "geomed-median": lambda: A.GeometricMedian(init="median"),
    "krum": lambda: A.Krum(F), "multikrum": lambda: A.MultiKrum(F),
    "bulyan": lambda: A.Bulyan(F), "mda": lambda: A.MinimumDiameterAveraging(2),
    "monna": lambda: A.MoNNA(F), "caf": lambda: A.CovarianceAgnosticFilter(F),
    "smea": lambda: A.SmallestMaxEigenvalueAveraging(2), "dnc": lambda: A.DivideAndConquer(F),
    "cc": lambda: A.CenteredClipping(1.0),
}
PRE = {"clipping": lambda: P.StaticClipping(1.0), "arc": lambda: P.AdaptiveRobustClipping(F),
       "nnm": lambda: P.NearestNeighborMixing(F), "bucketing": lambda: P.Bucketing(2)}
META = {"ctma": lambda: M.CenteredTrimmedMetaAggregator(F), "nnm": lambda: M.NNMMeta(F),
        "bucketing": lambda: M.BucketingMeta(2)}


def rows(seed: int = 0, bad: bool = False) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(N, D, generator=g) + torch.randn(D, generator=g)
    if bad:  # a NaN row and an infinite one, as Byzantine clients send
        x[3, 5] = float("nan")
        x[7, 0] = float("inf")
    return x


def same(cpu: torch.Tensor, cuda: torch.Tensor) -> None:
    assert cuda.device.type == "cuda"
    torch.testing.assert_close(cuda.cpu(), cpu, rtol=1e-4, atol=1e-4, equal_nan=True)


@pytest.mark.parametrize("bad", [False, True], ids=["finite", "nonfinite"])
@pytest.mark.parametrize("name", list(RULES))
def test_aggregator_on_cuda(name, bad):
    x = rows(bad=bad)
    same(RULES[name]()(x, generator=torch.Generator().manual_seed(1)),
         RULES[name]()(x.cuda(), generator=torch.Generator().manual_seed(1)))


@pytest.mark.parametrize("name", list(PRE))
def test_preaggregator_on_cuda(name):
    x = rows()
    same(PRE[name]()(x, generator=torch.Generator().manual_seed(1)),
         PRE[name]()(x.cuda(), generator=torch.Generator().manual_seed(1)))


@pytest.mark.parametrize("name", list(META))
def test_meta_on_cuda(name):
    x, inner = rows(), A.CoordinateWiseTrimmedMean(2)
    same(META[name]()(x, inner, generator=torch.Generator().manual_seed(1)),
         META[name]()(x.cuda(), inner, generator=torch.Generator().manual_seed(1)))


@pytest.mark.parametrize("name", [n for n, r in RULES.items() if r().traits.weighted])
def test_weighted_aggregator_on_cuda(name):
    rule, x = RULES[name](), rows()
    w = torch.arange(1, N + 1, dtype=torch.float64)
    same(rule(x, weights=w), rule(x.cuda(), weights=w))
    same(rule(x, weights=w), rule(x.cuda(), weights=w.cuda()))


def test_a_restored_centre_on_the_host_serves_a_cuda_aggregation():
    """A checkpoint loads centered clipping's centre on the host; the next aggregation runs
    on the server's device."""
    x = rows()
    on_host, on_cuda = A.CenteredClipping(1.0), A.CenteredClipping(1.0)
    on_host(x)
    on_cuda.load_state_dict(on_host.state_dict())
    same(on_host(x), on_cuda(x.cuda()))
