"""What moves a run's numbers between x86 machines, and what ``runtime.deterministic:
strict`` costs (docs/performance.md, "Reproducible on any machine").

Each row runs one scenario through ``fedray run --backend inline`` in a fresh process under
an environment that makes this machine's torch, MKL, oneDNN or numpy take the kernels
another machine would (a narrower instruction set), or under ``strict``; it prints the final
test accuracy of each seed, the test loss of seed 0 to the last digit, and the seconds the
runs took (MLflow's start and end of each point run, so without the process's start-up),
as a ratio to the first row's.

    python benchmarks/kernels.py                 # the docs' table: mnist_byzantine's Krum
                                                 # under sign flipping, then the quickstart
    python benchmarks/kernels.py --rounds 5      # a quick look
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from mlflow.tracking import MlflowClient

ROOT = Path(__file__).resolve().parents[1]
HIDE = "MKL_ENABLE_INSTRUCTIONS=SSE4_2 GLIBC_TUNABLES=glibc.cpu.hwcaps=-AVX2,-FMA,-AVX512F"
# (label, environment, runtime.deterministic)
SETTINGS = [
    ("this machine's kernels", "", "false"),
    ("ATen held to AVX2", "ATEN_CPU_CAPABILITY=avx2", "false"),
    ("oneDNN held to AVX2", "ONEDNN_MAX_CPU_ISA=AVX2", "false"),
    ("MKL's compatible path", "MKL_CBWR=COMPATIBLE", "false"),
    ("strict", "", "strict"),
    ("strict, MKL to SSE4.2, no FMA in libm", HIDE, "strict"),
]
WORKLOADS = {
    "mnist_byzantine krum sign_flip": (
        "scenarios/mnist_byzantine.yaml",
        ["sweep={aggregator.name: [krum], attack: [{name: sign_flip}]}"]),
    "quickstart": ("scenarios/quickstart.yaml", []),
}


def run(scenario: str, sets: list[str], env: str, mode: str, rounds: int | None
        ) -> tuple[list[float], float, float]:
    """(final test accuracy per seed, seed 0's final test loss, seconds of the runs)."""
    with tempfile.TemporaryDirectory() as tmp:
        uri = f"sqlite:///{tmp}/m.db"
        extra = [f"rounds={rounds}"] if rounds else []
        args = [a for s in [*sets, f"runtime.deterministic={mode}", *extra] for a in ("--set", s)]
        environ = {k: v for k, v in os.environ.items() if k != "MLFLOW_TRACKING_URI"}
        environ.update(kv.split("=", 1) for kv in env.split())
        done = subprocess.run([sys.executable, "-m", "fedray", "run", str(ROOT / scenario),
                               *args, "--backend", "inline", "--tracking-uri", uri, "--quiet"],
                              cwd=tmp, env=environ, capture_output=True, text=True, check=False)
        if done.returncode:
            raise SystemExit(f"{scenario} {env} {mode}: exit {done.returncode}\n"
                             f"{done.stderr[-2000:]}")
        client = MlflowClient(uri)
        points = [r for e in client.search_experiments()
                  for r in client.search_runs([e.experiment_id])
                  if r.data.tags.get("fedray.kind") == "point"]
        points.sort(key=lambda r: int(r.data.params.get("seed", 0)))
        accs = [r.data.metrics["eval/test_accuracy"] for r in points]
        seconds = sum((r.info.end_time - r.info.start_time) / 1000 for r in points)
        return accs, points[0].data.metrics["eval/test_loss"], seconds


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=None, help="override the scenarios' rounds")
    a = ap.parse_args()
    for name, (scenario, sets) in WORKLOADS.items():
        print(f"\n{name} ({scenario}{', ' + str(a.rounds) + ' rounds' if a.rounds else ''}):\n")
        print("| kernels | environment | final test accuracy per seed | mean ± std | "
              "test loss, seed 0 | seconds of the runs | x |")
        print("|---|---|---|---:|---|---:|---:|")
        base = None
        for label, env, mode in SETTINGS:
            accs, loss, seconds = run(scenario, sets, env, mode, a.rounds)
            base = base or seconds
            spread = statistics.stdev(accs) if len(accs) > 1 else 0.0
            print(f"| {label} | {env.replace('|', '/') or '-'} | "
                  f"{', '.join(f'{x:.4f}' for x in accs)} | "
                  f"{statistics.mean(accs):.3f} ± {spread:.3f} | {loss!r} | {seconds:.1f} | "
                  f"{seconds / base:.2f} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
