"""A third-party package with a plugin of every kind (tests/plugin_package), really installed:
every plugin passes the checks fedray ships, runs from a scenario, and the registry refuses
what breaks the contract (a class outside it, a name registered twice)."""

from __future__ import annotations

import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from fedray.testing import check_plugin
from simulator import registry
from simulator.config import ScenarioError
from simulator.config.load import load
from simulator.runtime.backend import InlineBackend
from simulator.sim.engine import Engine

PACKAGE = Path(__file__).parent.parent / "plugin_package"
NAMES = {"aggregators": "nanmedian", "preaggregators": "shrink", "meta": "recentered",
         "attacks": "shift", "topologies": "path_graph", "gossip_defenses": "damped",
         "optimizers": "scaled_step", "client_optimizers": "sign_momentum",
         "trainers": "full_batch", "privacy": "gaussian_sgd", "datasets": "blobs",
         "partitioners": "round_robin", "models": "tiny", "tasks": "hinge",
         "codecs": "rounded", "privacy_attacks": "confidence"}


def _install(src: Path, site: Path) -> None:
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps",
                    "--no-build-isolation", "--target", str(site), str(src)],
                   check=True, capture_output=True)


@pytest.fixture(scope="module")
def plugin_site(tmp_path_factory):
    site = tmp_path_factory.mktemp("site")
    src = tmp_path_factory.mktemp("src") / "kit"
    shutil.copytree(PACKAGE, src)
    _install(src, site)
    sys.path.insert(0, str(site))
    registry.refresh()
    yield site
    sys.path.remove(str(site))
    for mod in [m for m in sys.modules if m.startswith("fedray_plugin_kit")]:
        del sys.modules[mod]
    registry.refresh()


def test_the_package_covers_every_kind():
    assert set(NAMES) == set(registry.KINDS)


@pytest.mark.parametrize("kind", sorted(NAMES))
def test_every_plugin_of_the_package_passes_the_shipped_checks(plugin_site, kind):
    assert NAMES[kind] in registry.available(kind)
    check_plugin(kind, registry.get(kind, NAMES[kind]))


def _run(tmp_path: Path, text: str) -> object:
    p = tmp_path / "s.yaml"
    p.write_text(textwrap.dedent(text))
    return Engine(load(p).points[0].scenario, InlineBackend()).run()


def test_the_package_runs_from_scenarios(plugin_site, tmp_path):
    res = _run(tmp_path, """\
        rounds: 6
        data: {dataset: {name: blobs, samples: 600}, partitioner: {name: round_robin}}
        model: {name: tiny, hidden: 8}
        clients: {total: 10, byzantine: 2}
        local: {trainer: {name: full_batch, steps: 3}, lr: 0.5}
        aggregator: {name: nanmedian}
        preaggregators: [{name: shrink, alpha: 0.5}]
        meta: {name: recentered}
        attack: {name: shift, scale: 100.0}
        server: {optimizer: {name: scaled_step, lr: 1.0}}
        codecs: [{name: rounded, decimals: 4}]
    """)
    assert res.final("test_accuracy") > 0.8  # 3 blobs: chance is 1/3; the shift attack fails
    momentum = _run(tmp_path, """\
        rounds: 4
        data: {dataset: {name: blobs}}
        model: {name: tiny}
        clients: {total: 6}
        local: {optimizer: {name: sign_momentum, beta: 0.5}, lr: 0.05}
    """)
    assert momentum.final("test_accuracy") > 0.5
    private = _run(tmp_path, """\
        rounds: 2
        data: {dataset: {name: blobs}}
        model: {name: tiny}
        clients: {total: 4}
        privacy: {name: gaussian_sgd, noise_multiplier: 1.0}
    """)
    assert 0 < private.final("epsilon") < float("inf")
    attacked = _run(tmp_path, """\
        rounds: 2
        data: {dataset: {name: blobs}}
        model: {name: tiny}
        clients: {total: 4}
        privacy_attacks: [{name: confidence, power: 2.0}]
    """)
    assert 0 <= attacked.final("confidence_auc") <= 1
    assert attacked.final("confidence_advantage_bound") == 1.0  # no DP: no bound
    gossip = _run(tmp_path, """\
        rounds: 4
        data: {dataset: {name: blobs}}
        model: {name: tiny}
        clients: {total: 6}
        topology: {name: path_graph}
        dsgd: {defense: damped}
    """)
    assert gossip.final("consensus_distance") >= 0 and gossip.final("test_accuracy") > 0.5
    hinge = _run(tmp_path, """\
        rounds: 4
        data: {dataset: {name: blobs}}
        model: {name: tiny}
        clients: {total: 6}
        task: {name: hinge, margin: 1.0}
    """)
    assert hinge.final("test_accuracy") > 0.8 and hinge.final("test_loss") < 1.0
    # the kit's trainer does not take a task: it trains classifiers by cross-entropy only
    with pytest.raises(ScenarioError, match="local.trainer: 'full_batch' does not take 'task'"):
        _run(tmp_path, """\
            rounds: 1
            data: {dataset: {name: blobs}}
            model: {name: tiny}
            clients: {total: 6}
            task: {name: hinge}
            local: {trainer: {name: full_batch}}
        """)


BROKEN_PYPROJECT = """\
[build-system]
requires = ["setuptools>=61"]
build-backend = "setuptools.build_meta"

[project]
name = "fedray-broken-kit"
version = "0.0.1"

[project.entry-points."fedray.aggregators"]
mean = "fedray_broken_kit:MyMean"
plain_mean = "fedray_broken_kit:PlainMean"
"""

BROKEN_CODE = '''\
import torch

from strategies.protocols import Aggregator


class MyMean(Aggregator):
    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return x.mean(0)


class PlainMean:  # not a subclass of the contract
    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return x.mean(0)
'''


def test_a_name_registered_twice_and_a_class_outside_the_contract_are_refused(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    (src / "pyproject.toml").write_text(BROKEN_PYPROJECT)
    (src / "fedray_broken_kit.py").write_text(BROKEN_CODE)
    site = tmp_path / "site"
    _install(src, site)
    sys.path.insert(0, str(site))
    registry.refresh()
    try:
        with pytest.raises(registry.BadPlugin) as e:
            registry.available("aggregators")
        assert str(e.value).startswith("aggregator 'mean' is registered twice: "
                                       "strategies.aggregators:Mean (from fedray) and "
                                       "fedray_broken_kit:MyMean (from fedray-broken-kit)")
        assert registry.available("attacks")  # other kinds are unaffected
    finally:
        sys.path.remove(str(site))
        registry.refresh()
    (src / "pyproject.toml").write_text(BROKEN_PYPROJECT.replace('mean = "fedray_broken_kit:MyMean"\n', ""))
    site2 = tmp_path / "site2"
    _install(src, site2)
    sys.path.insert(0, str(site2))
    sys.modules.pop("fedray_broken_kit", None)
    registry.refresh()
    try:
        with pytest.raises(registry.BadPlugin, match=r"aggregator 'plain_mean' \(fedray_broken_kit:"
                           r"PlainMean \(from fedray-broken-kit\)\) does not subclass "
                           r"strategies\.protocols\.Aggregator"):
            registry.get("aggregators", "plain_mean")
    finally:
        sys.path.remove(str(site2))
        sys.modules.pop("fedray_broken_kit", None)
        registry.refresh()
