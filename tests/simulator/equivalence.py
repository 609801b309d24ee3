"""The equivalence set: small scenarios that between them run every path of the engine
(dropout and stragglers, FedProx's stragglers sending part of their epochs, a data-poisoning
attack, an omniscient attack through NNM and CWTM, client-level DP, worker momentum,
mu2-SGD, the vectorised trainer, a server optimizer with state, BatchNorm buffers, D-SGD,
top-k with error feedback). Ray must equal inline on each, to the bit
(tests/simulator/test_engine.py); ``python tests/simulator/equivalence.py OUT.json`` writes
each case's metrics and final parameters' digest, to compare two versions of the engine."""

from __future__ import annotations

import hashlib
import json
import sys
import tempfile
from pathlib import Path

BASE = """\
name: equivalence
rounds: 3
data: {dataset: {name: digits}}
model: {name: logreg}
clients: {total: 12, per_round: 6}
local: {steps: 2, batch_size: 16, lr: 0.2}
"""

CASES: dict[str, list[str]] = {
    "dropout-stragglers": ["clients.dropout=0.3", "clients.stragglers={deadline: 1.5, sigma: 1.0}",
                           "local.steps=null", "local.epochs=1"],
    # FedProx's own stragglers: half of each round's clients send 1 or 2 of their 2 epochs,
    # through the stacked trainer (rows of unequal steps on each worker)
    "epoch-stragglers": ["clients.stragglers={kind: epochs, fraction: 0.5, partial: true}",
                         "local.steps=null", "local.epochs=2",
                         "local.trainer={name: vectorized_sgd}"],
    "label-flip": ["clients.byzantine=2", "attack={name: label_flip}",
                   "aggregator={name: median}"],
    "alie-nnm-cwtm": ["clients.byzantine=2", "attack={name: alie}",
                      "preaggregators=[{name: nnm, f: 2}]", "aggregator={name: cwtm, f: 2}"],
    "dp-fedavg": ["privacy={name: dp_fedavg, clip: 0.5, noise_multiplier: 0.5}"],
    "momentum": ["local.steps=1", "local.optimizer={name: momentum, beta: 0.9}",
                 "runtime.checkpoint_every=2"],
    "mu2sgd": ["local.steps=null", "server.optimizer={name: mu2sgd}"],
    # the trainer named: runtime.vectorize would time it against the loop and keep the faster
    "vectorized": ["local.trainer={name: vectorized_sgd}"],
    "fedadam": ["server.optimizer={name: fedadam, lr: 0.05}"],
    "batchnorm": ["model={name: cnn, channels: [4], hidden: 8, norm: batch}",
                  "clients.byzantine=1", "attack={name: sign_flip}",
                  "aggregator={name: median}"],
    "dsgd": ["topology={name: ring}", "clients.per_round=null", "clients.total=8"],
    # compressed payloads with error feedback (per-client residuals in the workers), an
    # omniscient attack that reads them back and sends its own through the codec
    "top-k-ef": ["codecs=[{name: top_k, fraction: 0.1, error_feedback: true}]",
                 "downlink=[{name: top_k, fraction: 0.2}]",
                 "clients.byzantine=2", "attack={name: alie}", "aggregator={name: cwtm, f: 2}"],
    # secure aggregation over groups with client-level DP's noise shares
    "secagg-dp": ["codecs=[{name: secagg, group_size: 3, range: 10.0, dropout: 0.2}]",
                  "privacy={name: dp_fedavg, clip: 1.0, noise_multiplier: 0.5}"],
    # an audit of DP-FedAvg: canary rows appended on the server, their statistics
    "audit-dp": ["privacy={name: dp_fedavg, clip: 0.5, noise_multiplier: 0.5}",
                 "audit={canaries: 12, every: 2}"],
    # privacy attacks: a reconstruction of round 2's first client, a membership attack
    "privacy-attacks": [("privacy_attacks=[{name: inverting_gradients, round: 2, "
                         "iterations: 30}, {name: loss_threshold}]")],
    # Byzantine payloads built by their clients: words beyond the clip wrap a group's sum
    "secagg-crafted": ["codecs=[{name: secagg, group_size: 2, bits: 16, range: 1.0}]",
                       "clients.byzantine=2", "attack={name: crafted_ipm, epsilon: 20.0}",
                       "aggregator={name: median}"],
}


def scenario(case: str, folder: Path):
    from simulator.config.load import load

    p = folder / f"{case}.yaml"
    p.write_text(BASE)
    return load(p, CASES[case]).points[0].scenario


def digest(params) -> str:
    return hashlib.sha256(params.tobytes()).hexdigest()[:16]


def main(out: str) -> None:
    from simulator.runtime.backend import InlineBackend
    from simulator.sim.engine import Engine

    got = {}
    with tempfile.TemporaryDirectory() as tmp:
        for case in CASES:
            res = Engine(scenario(case, Path(tmp)), InlineBackend(), workers=2).run()
            got[case] = {"metrics": res.metrics, "final": digest(res.final_params)}
            print(case, res.final("test_accuracy"), got[case]["final"], flush=True)
    Path(out).write_text(json.dumps(got, sort_keys=True))


if __name__ == "__main__":
    main(sys.argv[1])
