"""Run by tests/simulator/test_cluster.py in a fresh process: a Ray cluster of a head (no CPU)
and two worker nodes of one CPU each on this machine (ray.cluster_utils.Cluster), a run whose
two ClientWorkers take both CPUs, then the same run with one worker node removed after round
2: no CPU is left for a replacement, so the lost worker's clients must move to the live one.
Prints one JSON line with what the test asserts."""

from __future__ import annotations

import json
import os
import sys
import time

os.environ.setdefault("RAY_AUTH_MODE", "disabled")

import ray
from ray.cluster_utils import Cluster

from simulator.config.load import load
from simulator.runtime.backend import RayBackend
from simulator.sim.engine import Engine


def main(scenario_path: str) -> None:
    cluster = Cluster(initialize_head=True, head_node_args={
        "num_cpus": 0, "object_store_memory": 200 * 1024**2, "include_dashboard": False,
        "_system_config": {
            "health_check_period_ms": 500, "health_check_failure_threshold": 2,
            "health_check_initial_delay_ms": 0}})
    nodes = [cluster.add_node(num_cpus=1, object_store_memory=200 * 1024**2) for _ in range(2)]
    cluster.wait_for_nodes()
    ray.init(address=cluster.address, include_dashboard=False, log_to_driver=False)
    backend = RayBackend()
    sc = load(scenario_path).points[0].scenario

    engine = Engine(sc, backend, workers=2)
    placed: list = []

    def where(r, m):
        if r == 0:
            placed.extend(backend.get([w.node() for w in engine.pool.workers]))

    full = engine.run(where)
    worker_nodes = sorted(n.node_id for n in nodes)

    engine = Engine(sc, backend, workers=2)
    killed: list = []

    def kill_after_round_2(r, m):
        if r == 1:
            victim = backend.get(engine.pool.workers[0].node())
            node = next(n for n in nodes if n.node_id == victim)
            cluster.remove_node(node)
            deadline = time.monotonic() + 60
            while any(n["NodeID"] == victim and n["Alive"] for n in ray.nodes()):
                if time.monotonic() > deadline:
                    raise RuntimeError("the removed node is still alive after 60 s")
                time.sleep(0.2)
            killed.append(victim)

    t0 = time.monotonic()
    faulty = engine.run(kill_after_round_2)
    print(json.dumps({
        "seconds": time.monotonic() - t0, "live_workers": len(engine.pool.live),
        "placed": sorted(placed), "worker_nodes": worker_nodes, "killed": killed,
        "same_metrics": faulty.metrics == full.metrics, "rounds": len(faulty.metrics),
        "final_equal": bool((faulty.final_params == full.final_params).all()),
        "alive_nodes": sum(1 for n in ray.nodes() if n["Alive"]),
    }), flush=True)
    ray.shutdown()
    cluster.shutdown()


if __name__ == "__main__":
    main(sys.argv[1])
