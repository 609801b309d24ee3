"""Start-up: how long a user waits for the first round, against `python -c "import torch"`.

Runs each command in a fresh process in a temporary folder (so the embedded MLflow store is
the one a user has after a first run: it exists), the median of ``--repeat`` runs:

* ``import torch``, the yardstick;
* ``fedray run scenarios/quickstart.yaml`` on the inline backend and on a fresh local Ray
  instance: the time from the process start to the end of round 1 (its progress line), and
  to the end of the process (``--rounds`` rounds);
* the finish time: a one-round run of each backend, from the process start to its end (the
  run, its artifacts and its status in MLflow), against ``import torch``; and for the inline
  backend where those seconds go after the round (one run, instrumented: the wait for the
  MLflow run to be open, each callback's end, the statuses, the process's exit);
* ``fedray validate``, ``show`` and ``list``, and whether each imports torch, Ray or MLflow;

then the import-time breakdown of the inline run (``-X importtime``): the cumulative time of
each top-level package, and who imports it.

    python benchmarks/startup.py [--repeat 3] [--rounds 3]
"""

from __future__ import annotations

import argparse
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
HEAVY = ("torch", "ray", "mlflow")


def timed(cmd: list[str], cwd: Path, marker: str | None = None) -> tuple[float, float]:
    """(seconds to the first stderr line containing ``marker``, seconds to the end)."""
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, cwd=cwd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            text=True, env={**os.environ, "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"})
    first: float | None = None
    said: list[str] = []
    assert proc.stderr is not None
    for line in proc.stderr:
        said = [*said[-5:], line.rstrip()]
        if marker and first is None and marker in line:
            first = time.perf_counter() - t0
    if proc.wait() != 0:
        raise RuntimeError(f"{' '.join(cmd[2:5])} failed: " + " | ".join(said))
    return (float("nan") if first is None else first), time.perf_counter() - t0


def median_of(n: int, cmd: list[str], cwd: Path, marker: str | None = None
              ) -> tuple[float, float]:
    runs = [timed(cmd, cwd, marker) for _ in range(n)]
    return statistics.median(r[0] for r in runs), statistics.median(r[1] for r in runs)


def _child_timeline(argv: list[str]) -> None:
    """``fedray ARGV`` in this process, saying on stderr (``@@ ...`` lines, flushed) when the
    MLflow run it waited for was open, how long each callback's end took, and when the
    command returned; the parent stamps the lines as they come."""
    import functools

    from simulator.run import callbacks, experiment

    def say(text: str) -> None:
        print(f"@@ {text}", file=sys.stderr, flush=True)

    prop = vars(callbacks.PointRun)["run_id"]
    opened = prop.fget

    def run_id(self: callbacks.PointRun) -> str:
        if not self.opening.done():
            out = opened(self)
            say("mlflow-open")
            return out
        return opened(self)

    callbacks.PointRun.run_id = property(run_id)  # type: ignore[assignment]
    end = experiment.Experiment.end

    @functools.wraps(end)
    def timed_end(self: experiment.Experiment, run: callbacks.PointRun, result: object,
                  status: str) -> None:
        for cb in self.callbacks:
            if not hasattr(cb, "_timed"):
                inner = cb.on_end

                def on_end(*a: object, _inner: object = inner, _cb: object = cb) -> None:
                    t = time.perf_counter()
                    _inner(*a)  # type: ignore[operator]
                    say(f"end {type(_cb).__name__} {time.perf_counter() - t:.3f}")

                cb.on_end = on_end  # type: ignore[method-assign,assignment]
                cb._timed = True  # type: ignore[attr-defined]
        say("engine-done")
        end(self, run, result, status)
        say("status-set")

    experiment.Experiment.end = timed_end  # type: ignore[method-assign]
    from fedray.cli import main as cli_main

    rc = cli_main(argv)
    say("returned")
    sys.exit(rc)


def timeline(cmd: list[str], cwd: Path) -> dict[str, float]:
    """The ``@@`` events of ``cmd`` (run through ``_child_timeline``): seconds from the
    process start to each, ``end NAME`` as the callback's own seconds; ``round`` for the end
    of round 1 and ``exit`` for the process end."""
    t0 = time.perf_counter()
    proc = subprocess.Popen([PY, __file__, "--child-timeline", *cmd[3:]], cwd=cwd,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"})
    out: dict[str, float] = {}
    assert proc.stderr is not None
    for line in proc.stderr:
        now = time.perf_counter() - t0
        if line.startswith("@@ end "):
            _, _, name, seconds = line.split()
            out[f"end {name}"] = float(seconds)
        elif line.startswith("@@ "):
            out.setdefault(line.split()[1], now)
        elif "round 1/" in line:
            out.setdefault("round", now)
    if proc.wait() != 0:
        raise RuntimeError("the instrumented run failed")
    out["exit"] = time.perf_counter() - t0
    return out


def print_parts(parts: dict[str, float]) -> None:
    """Where a one-round run's seconds go after its round."""
    start = parts.get("round", float("nan"))
    print(f"  round 1 ends                      {start:6.2f} s")
    if "mlflow-open" in parts:
        print(f"  waiting for the MLflow run        {parts['mlflow-open'] - start:6.2f} s "
              "(MLflow's import and store, on the opening thread)")
    for key, seconds in parts.items():
        if key.startswith("end "):
            print(f"  end: {key[4:]:28} {seconds:6.2f} s")
    print(f"  the ends and statuses, in all     {parts['returned'] - parts['engine-done']:6.2f} s")
    print(f"  the process's exit                {parts['exit'] - parts['returned']:6.2f} s")
    print(f"  process end                       {parts['exit']:6.2f} s")


def importtime(cmd: list[str], cwd: Path) -> list[tuple[int, int, str]]:
    """(depth, cumulative microseconds, module) of each import of ``cmd`` under -X importtime,
    in the order Python prints them (children before their parent)."""
    out = subprocess.run([PY, "-X", "importtime", *cmd[1:]], cwd=cwd, capture_output=True,
                         text=True, check=True, env={**os.environ, "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"})
    rows = []
    for line in out.stderr.splitlines():
        m = re.match(r"import time:\s+(\d+) \|\s+(\d+) \|( *)(\S+)", line)
        if m:
            rows.append((len(m.group(3)) // 2, int(m.group(2)), m.group(4)))
    return rows


def top_packages(rows: list[tuple[int, int, str]]) -> list[tuple[str, float, str]]:
    """(package, seconds, the fedray module that imports it) for each package's first
    import (its outermost row: ``from mlflow.tracking import`` counts all of mlflow),
    largest first."""
    ours = ("fedray", "simulator", "strategies", "dashboards", "benchmarks")

    def parent(i: int) -> int | None:
        return next((j for j in range(i + 1, len(rows)) if rows[j][0] < rows[i][0]), None)

    out: dict[str, tuple[float, str]] = {}
    for i, (_, _, name) in enumerate(rows):
        top = name.split(".")[0]
        if top in out or top in ours:
            continue
        outer, j = i, parent(i)
        while j is not None and rows[j][2].split(".")[0] == top:
            outer, j = j, parent(j)
        who = rows[j][2] if j is not None and rows[j][2].split(".")[0] in ours else \
            "(a function's import)" if j is None else rows[j][2]
        out[top] = (rows[outer][1] / 1e6, who)
    return sorted(((k, s, w) for k, (s, w) in out.items()), key=lambda r: -r[1])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="fedray-startup-") as d:
        cwd = Path(d)
        run = [*FEDRAY, "run", QUICK, "--set", f"rounds={args.rounds}", "--quiet"]
        timed([*run, "--backend", "inline"], cwd)  # creates the store (what a first run pays)
        torch_s = median_of(args.repeat, [PY, "-c", "import torch"], cwd)[1]
        print(f"python -c 'import torch'      {torch_s:6.2f} s (median of {args.repeat})")
        marker = "round 1/"
        for backend in ("inline", "ray"):
            first, end = median_of(args.repeat, [*run, "--backend", backend], cwd, marker)
            print(f"fedray run ({backend:6}) first round {first:6.2f} s = {first / torch_s:4.2f}x "
                  f"import torch; whole run ({args.rounds} rounds) {end:6.2f} s")
        # the finish: import torch and the two one-round runs in turn, so that each ratio
        # compares commands run under the same load
        one = [*FEDRAY, "run", QUICK, "--set", "rounds=1", "--quiet"]
        cmds = {"import torch": [PY, "-c", "import torch"],
                **{b: [*one, "--backend", b] for b in ("inline", "ray")}}
        ends: dict[str, list[float]] = {k: [] for k in cmds}
        for _ in range(args.repeat):
            for k, cmd in cmds.items():
                ends[k].append(timed(cmd, cwd)[1])
        yard = statistics.median(ends.pop("import torch"))
        for backend, times in ends.items():
            end = statistics.median(times)
            print(f"fedray run ({backend:6}) one round: finished at {end:6.2f} s = "
                  f"{end / yard:4.2f}x import torch ({yard:.2f} s in turn with it)")
        print("after the round of a one-round inline run (one instrumented run):")
        print_parts(timeline([*one, "--backend", "inline"], cwd))
        for sub in (["validate", QUICK], ["show", QUICK], ["list"]):
            s = median_of(args.repeat, [*FEDRAY, *sub], cwd)[1]
            mods = {name.split(".")[0] for _, _, name in importtime([*FEDRAY, *sub], cwd)}
            heavy = [m for m in HEAVY if m in mods]
            print(f"fedray {sub[0]:8}                 {s:6.2f} s; imports "
                  f"{', '.join(heavy) if heavy else 'none of torch, ray, mlflow'}")
        print("\nimport time of `fedray run --backend inline` (cumulative, first import of each "
              "package; MLflow's on its own thread):")
        for name, s, who in top_packages(importtime([*run, "--backend", "inline"], cwd))[:14]:
            print(f"  {name:22} {s:6.2f} s  <- {who}")


if __name__ == "__main__":
    if sys.argv[1:2] == ["--child-timeline"]:
        _child_timeline(sys.argv[2:])
    else:
        main()
