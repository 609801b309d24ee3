"""The measurements behind ``runtime.backend: auto`` (``simulator.runtime.backend``'s
constants and rule; docs/performance.md, "The backend a run chooses").

1. Ray's fixed cost, in a fresh process: ``ray.init`` of a new local instance, then the
   quickstart's actors (``--workers`` ClientWorkers and the server; each imports torch and
   fedray) until they answer, for 1 and 2 workers: the start ``S``.
2. A round's extra cost on Ray: the quickstart's rounds on Ray (2 workers) against the same
   rounds inline, ``(ray - inline / 2) / rounds``.
3. Whole runs through the CLI, in a folder whose MLflow store exists, for workloads from
   a few seconds of rounds to a minute: the work ``auto`` estimates (``fedray show``'s
   line), the wall time of ``fedray run`` on ``--backend inline``, ``ray`` and the default
   (``auto``), interleaved (each first in turn: a run right after one on Ray shares the
   machine with Ray's exiting processes), the median of ``--repeat``; and which of inline
   and ray was the faster (auto's choice is in its estimate's column).

    python benchmarks/backend_choice.py [--repeat 3] [--only quickstart-30,heavy-40]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PY = sys.executable
FEDRAY = [PY, "-m", "fedray"]
QUICK = str(ROOT / "scenarios" / "quickstart.yaml")
ENV = {**os.environ, "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "RAY_ADDRESS": "local"}
# benchmarks/vs_flower.py's heavy workload: 200 clients of 300 samples, 20 a round, MLP [1024]
HEAVY = """\
name: heavy
rounds: 10
data:
  dataset: {name: gaussian-mixture, samples: 66667, dimension: 60, classes: 10,
            separation: 0.5}
  partitioner: {name: iid}
  test_fraction: 0.1
model: {name: mlp, hidden: [1024]}
clients: {total: 200, per_round: 20}
local: {epochs: 1, batch_size: 16, lr: 0.05}
evaluation: {every: 10}
"""
# (name, scenario, --set overrides)
WORKLOADS = [
    ("quickstart-1", QUICK, ["rounds=1"]),
    ("quickstart-30", QUICK, []),
    ("quickstart-300", QUICK, ["rounds=300"]),
    ("heavy-10", "HEAVY", []),
    ("heavy-40", "HEAVY", ["rounds=40"]),
    ("heavy-120", "HEAVY", ["rounds=120"]),
    ("heavy-240", "HEAVY", ["rounds=240"]),
]

START = """\
import json, sys, time
t0 = time.perf_counter()
from simulator.config.load import load
from simulator.runtime.backend import RayBackend
from simulator.sim.engine import Engine
out = {"imports": time.perf_counter() - t0}
t = time.perf_counter()
backend = RayBackend(num_cpus=int(sys.argv[2]))
out["ray_init"] = time.perf_counter() - t
sc = load(sys.argv[1], ["rounds=30"]).points[0].scenario
engine = Engine(sc, backend, workers=int(sys.argv[3]))
t = time.perf_counter()
engine.start()
out["actors"] = time.perf_counter() - t
res = engine.run()
out["rounds"] = sum(r["round_seconds"] for r in res.timings)
backend.shutdown()
print(json.dumps(out))
"""
INLINE_ROUNDS = """\
import json, sys
from simulator.config.load import load
from simulator.runtime.backend import InlineBackend
from simulator.sim.engine import Engine
sc = load(sys.argv[1], ["rounds=30"]).points[0].scenario
res = Engine(sc, InlineBackend()).run()
print(json.dumps({"rounds": sum(r["round_seconds"] for r in res.timings)}))
"""


def child(code: str, *args: str) -> dict:
    out = subprocess.run([PY, "-c", code, *args], capture_output=True, text=True, env=ENV,
                         check=True, timeout=600)
    return json.loads(out.stdout.strip().splitlines()[-1])


def wall(cmd: list[str], cwd: Path) -> float:
    t0 = time.perf_counter()
    subprocess.run(cmd, cwd=cwd, env=ENV, check=True, stdout=subprocess.DEVNULL,
                   stderr=subprocess.DEVNULL, timeout=900)
    return time.perf_counter() - t0


def estimate_line(path: str, sets: list[str], cwd: Path) -> str:
    out = subprocess.run([*FEDRAY, "show", path, *(a for s in sets for a in ("--set", s))],
                         cwd=cwd, env=ENV, capture_output=True, text=True, check=True)
    line = next(x for x in out.stdout.splitlines() if x.startswith("# backend:"))
    m = re.search(r"backend: (\w+) \(auto: the rounds' work is estimated at .*= ([\d.]+) s in "
                  r"one process; on Ray ([\d.]+) s", line)
    return f"{m.group(2)} s inline, {m.group(3)} s on Ray: {m.group(1)}" if m else line


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--only", default="", help="comma-separated workload names")
    ap.add_argument("--skip-start", action="store_true", help="skip parts 1 and 2")
    args = ap.parse_args()
    print(f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores at the start")
    if not args.skip_start:
        for workers in (1, 2):
            runs = [child(START, QUICK, "2", str(workers)) for _ in range(args.repeat)]
            med = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
            inits = ", ".join(f"{r['ray_init']:.2f}" for r in runs)
            actors = ", ".join(f"{r['actors']:.2f}" for r in runs)
            print(f"Ray, {workers} ClientWorker(s) + the server: ray.init {med['ray_init']:.2f} s "
                  f"(runs: {inits}), the actors answer {med['actors']:.2f} s after they are "
                  f"spawned ({actors}); 30 quickstart rounds {med['rounds']:.2f} s", flush=True)
            if workers == 2:
                ray_rounds = med["rounds"]
        inline = statistics.median(child(INLINE_ROUNDS, QUICK)["rounds"]
                                   for _ in range(args.repeat))
        print(f"inline: 30 quickstart rounds {inline:.2f} s; a round's extra cost on Ray "
              f"(2 workers): {(ray_rounds - inline / 2) / 30 * 1e3:.1f} ms")
    only = set(filter(None, args.only.split(",")))
    with tempfile.TemporaryDirectory(prefix="fedray-backend-") as d:
        cwd = Path(d)
        (cwd / "heavy.yaml").write_text(HEAVY)
        wall([*FEDRAY, "run", QUICK, "--set", "rounds=1", "--backend", "inline", "--quiet"],
             cwd)  # the store
        print("\n| workload | auto's estimate (`fedray show`) | inline | ray | auto | "
              "the faster |\n|---|---|---:|---:|---:|---|")
        for name, path, sets in WORKLOADS:
            if only and name not in only:
                continue
            path = str(cwd / "heavy.yaml") if path == "HEAVY" else path
            if name.startswith("heavy"):
                rounds = sets[0].split("=")[1] if sets else "10"
                sets = [*sets, f"evaluation.every={rounds}"]
            est = estimate_line(path, sets, cwd)
            base = [*FEDRAY, "run", path, "--quiet", *(a for s in sets for a in ("--set", s))]
            times: dict[str, list[float]] = {"inline": [], "ray": [], "auto": []}
            order = list(times)
            for i in range(args.repeat):  # each first once: a run after Ray's pays its exit
                for b in order[i % 3:] + order[:i % 3]:
                    times[b].append(wall([*base, *(["--backend", b] if b != "auto" else [])],
                                         cwd))
            med = {b: statistics.median(t) for b, t in times.items()}
            print(f"| {name} | {est} | {med['inline']:.1f} s | {med['ray']:.1f} s | "
                  f"{med['auto']:.1f} s | {min(('inline', 'ray'), key=med.__getitem__)} |",
                  flush=True)
    print(f"load average {os.getloadavg()[0]:.1f} at the end")


if __name__ == "__main__":
    main()
