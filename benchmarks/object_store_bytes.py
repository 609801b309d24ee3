"""What crosses Ray's object store with a codec chain: the same small run (digits, MLP
[1024], 12 clients, 6 a round, 3 rounds) with ``codecs: []`` (the identity), ``float16``
and ``top_k`` (1 %), on a local ``ray.cluster_utils.Cluster`` (a head of 0 CPUs, two worker
nodes of 1 CPU each, 200 MiB of object store each, 127.0.0.1 only) through RayBackend with
2 workers, one on each worker node.

    python benchmarks/object_store_bytes.py [--rounds 3] [--hidden 1024]

Every ``ClientWorker.train`` result's ObjectRef is kept (RayBackend.call, wrapped) and read
back two ways: the size Ray reports (``ray.experimental.get_object_locations``:
``object_size``, data + metadata; results under 100 KiB are inlined in the owner's memory
store rather than put in the plasma store, and Ray may report no size for them) and the
size of the result serialized by Ray's own serialization context (what any result costs,
inlined or not). Per round: the sum over the round's train results (one a worker). The
declared bytes are ``6 x strategies.codecs.chain_bytes(chain, shape)``, the codec's
``layout``; the measured ratio to the identity is compared with the declared ratio.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from collections import defaultdict
from pathlib import Path

os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
os.environ.pop("RAY_ADDRESS", None)

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

SCENARIO = """\
name: object-store-bytes
rounds: {rounds}
seeds: [0]
data:
  dataset: {{name: digits}}
  partitioner: {{name: iid}}
model: {{name: mlp, hidden: [{hidden}]}}
clients: {{total: 12, per_round: 6}}
local: {{steps: 2, batch_size: 16, lr: 0.1}}
aggregator: {{name: mean}}
codecs: {codecs}
"""

CHAINS = {
    "identity": "[]",
    "float16": "[{name: float16}]",
    "top_k (1 %)": "[{name: top_k, fraction: 0.01}]",
}
MiB = 1024**2


def serialized_bytes(value) -> int:
    """The bytes of ``value`` serialized as Ray stores a task's result (its serialization
    context); pickled with Ray's cloudpickle where that object has no size."""
    import ray

    ctx = ray._private.worker.global_worker.get_serialization_context()
    try:
        return int(ctx.serialize(value).total_bytes)
    except AttributeError:
        return len(ray.cloudpickle.dumps(value))


def measure(ray, scenario_path: Path, rounds: int) -> dict:
    """One run: per round, (Ray's object_size sum, serialized sum, results), the declared
    bytes_up of the engine and 6 x chain_bytes."""
    from simulator.config.load import load
    from simulator.config.plan import build_codecs
    from simulator.runtime.backend import RayBackend
    from simulator.runtime.worker import ClientWorker
    from simulator.sim.engine import Engine
    from strategies.codecs import chain_bytes

    class Keeping(RayBackend):
        """RayBackend keeping the ObjectRef of every ClientWorker.train call, by round."""

        def __init__(self) -> None:
            super().__init__()
            self.round = 0
            self.train: dict[int, list] = defaultdict(list)

        def call(self, handle, method, *args):
            ref = super().call(handle, method, *args)
            if method is ClientWorker.train:
                self.train[self.round].append(ref)
            return ref

    sc = load(scenario_path).points[0].scenario
    backend = Keeping()
    engine = Engine(sc, backend, workers=2)
    nodes: list[str] = []
    shape = None

    def on_round(r, m):
        nonlocal shape
        if r == 0:
            nodes.extend(backend.get([w.node() for w in engine.pool.workers]))
            shape = engine.protocol.shape
        backend.round = r + 1

    res = engine.run(on_round)
    chain = build_codecs(engine.plan)
    out = {"nodes": nodes, "rounds": [], "bytes_up": [m["bytes_up"] for m in res.metrics],
           "declared": sc.clients.per_round * chain_bytes(chain, shape), "shape": shape}
    for r in range(rounds):
        refs = backend.train[r]
        locs = ray.experimental.get_object_locations(refs)
        sizes = [locs.get(ref, {}).get("object_size") for ref in refs]
        values = ray.get(refs)
        sent = [v for v in values if len(v.clients)]
        out["rounds"].append({
            "results": len(sent),
            "clients": sum(len(v.clients) for v in values),
            "object_size": None if any(s is None for s in sizes) else sum(sizes),
            "in_plasma": sum(1 for ref in refs if locs.get(ref, {}).get("node_ids")),
            "serialized": sum(serialized_bytes(v) for v in values),
            "payload": sum(int(getattr(v.updates, "nbytes", 0)) for v in values),
        })
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--hidden", type=int, default=1024)
    args = ap.parse_args()

    import ray
    from ray.cluster_utils import Cluster

    cluster = Cluster(initialize_head=True, head_node_args={
        "num_cpus": 0, "object_store_memory": 200 * MiB, "include_dashboard": False,
        "node_ip_address": "127.0.0.1"})
    for _ in range(2):
        cluster.add_node(num_cpus=1, object_store_memory=200 * MiB,
                         node_ip_address="127.0.0.1")
    cluster.wait_for_nodes()
    ray.init(address=cluster.address, include_dashboard=False, log_to_driver=False)
    folder = Path(tempfile.mkdtemp(prefix="fedray-osb-"))
    got: dict[str, dict] = {}
    try:
        for name, codecs in CHAINS.items():
            p = folder / f"{len(got)}.yaml"
            p.write_text(SCENARIO.format(rounds=args.rounds, hidden=args.hidden, codecs=codecs))
            got[name] = measure(ray, p, args.rounds)
    finally:
        ray.shutdown()
        cluster.shutdown()

    first = next(iter(got.values()))
    shape = first["shape"]
    print(f"d = {shape.width:,} (MLP [{args.hidden}] on digits, layers "
          f"{', '.join('x'.join(map(str, s)) for s in shape.shapes)}); 12 clients, 6 a round, "
          f"{args.rounds} rounds; 2 ClientWorkers on 2 nodes "
          f"({len(set(first['nodes']))} distinct); per round, summed over the "
          "ClientWorker.train results (one a worker)\n")

    def per_round(v: dict, key: str) -> float | None:
        xs = [r[key] for r in v["rounds"]]
        return None if any(x is None for x in xs) else sum(xs) / len(xs)

    ident = got["identity"]
    base = {k: per_round(ident, k) for k in ("object_size", "serialized")}
    print("| codec | Ray object_size B/round | results in plasma | serialized B/round | "
          "ratio to identity | declared B/round (6 x chain_bytes) | declared ratio | "
          "measured / declared ratio |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for name, v in got.items():
        osz, ser = per_round(v, "object_size"), per_round(v, "serialized")
        plasma = sum(r["in_plasma"] for r in v["rounds"])
        total = sum(r["results"] for r in v["rounds"])
        # what Ray reports where it reports a size for every result, else the serialized size
        if osz is not None and base["object_size"]:
            ratio = osz / base["object_size"]
        else:
            ratio = ser / base["serialized"]
        decl_ratio = v["declared"] / ident["declared"]
        osz_text = f"{osz:,.0f}" if osz is not None else "not reported"
        print(f"| {name} | {osz_text} | {plasma}/{total} | {ser:,.0f} | {ratio:.4f} | "
              f"{v['declared']:,} | {decl_ratio:.4f} | {ratio / decl_ratio - 1:+.1%} |")
    over = [(r["serialized"] - r["payload"]) / r["results"] for v in got.values()
            for r in v["rounds"] if r["results"]]
    print(f"\nEach train result carries {min(over):,.0f}-{max(over):,.0f} serialized bytes beyond "
          "its payload's arrays (the clients' ids, losses, the call's seconds, pickling); "
          "results under 100 KiB are inlined, not put in the plasma store.")
    for name, v in got.items():
        bu = v["bytes_up"]
        if any(b != v["declared"] for b in bu):
            print(f"\n{name}: the engine's bytes_up {bu} differs from 6 x chain_bytes "
                  f"{v['declared']}")


if __name__ == "__main__":
    main()
