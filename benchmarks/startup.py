"""Start-up: how long a user waits for a one-round run, against `python -c "import torch"`.

Each command runs in a fresh process, interleaved with ``import torch`` (the yardstick,
measured in the same run), the median of ``--repeat`` rounds of the whole matrix:

* ``fedray run scenarios/quickstart.yaml --set rounds=1`` with its defaults (the scenario's
  ``runtime.backend``: ``auto``; ``ray`` before auto existed) and with ``--backend inline``
  and ``--backend ray``; each **with a new store** (a new folder: the embedded MLflow store
  is created, from the store template of this MLflow version in the benchmark's own
  ``XDG_CACHE_HOME``, made by one run first) and **with an existing store** (a folder where
  the command ran before): the time from the process start to the end of round 1 (its
  progress line) and to the end of the process (the run, its artifacts and its status in
  MLflow), each as a ratio to ``import torch``;
* the first new store of an MLflow version (no template yet: MLflow's migrations), once;
* where a one-round inline run's seconds go after its round (one instrumented run: the
  wait for the MLflow run to be open, each callback's end, the statuses, the exit);
* ``fedray validate``, ``show`` and ``list``, and whether each imports torch, Ray or MLflow;

the same on a warm pool (``fedray up``, in the benchmark's own ``XDG_RUNTIME_DIR``; every
other row runs with ``FEDRAY_POOL=0``), beside ``import torch`` measured again in that series;
then the import-time breakdown of the inline run (``-X importtime``): the cumulative time of
each top-level package, and who imports it.

    python benchmarks/startup.py [--repeat 3] [--root DIR] [--pool-only]

``--root``: the checkout whose ``scenarios/quickstart.yaml`` runs (the code is whatever
``python -m fedray`` imports: set PYTHONPATH to measure another checkout, e.g. the commit
before a change: ``PYTHONPATH=../main python benchmarks/startup.py --root ../main``).
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
HEAVY = ("torch", "ray", "mlflow")


def timed(cmd: list[str], cwd: Path, marker: str | None = None,
          env: dict[str, str] | None = None) -> tuple[float, float]:
    """(seconds to the first stderr line containing ``marker``, seconds to the end)."""
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, cwd=cwd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            text=True, env={**os.environ, "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",
                                            **(env or {})})
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
    from fedray import cli

    command = cli.main

    def main(_: list[str] | None = None) -> int:
        rc = command(argv)
        say("returned")
        return rc

    cli.main = main  # type: ignore[assignment]
    if hasattr(cli, "entry"):
        cli.entry()  # the process ends as `fedray` ends it
    sys.exit(main())  # a checkout from before fedray.cli.entry


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


def one_round(root: Path, backend: str | None) -> list[str]:
    quick = str(root / "scenarios" / "quickstart.yaml")
    return [*FEDRAY, "run", quick, "--set", "rounds=1", "--quiet",
            *(["--backend", backend] if backend else [])]


def matrix(root: Path, base: Path, repeat: int) -> None:
    """The one-round runs on each backend, with a new and an existing store, interleaved
    with ``import torch``: medians, and ratios to the yardstick's median."""
    backends: list[str | None] = [None, "inline", "ray"]
    first: dict[tuple[str | None, str], list[float]] = {}
    end: dict[tuple[str | None, str], list[float]] = {}
    torch_s: list[float] = []
    existing = base / "existing"
    existing.mkdir()
    timed(one_round(root, "inline"), existing)  # its store exists from now on
    for i in range(repeat):
        torch_s.append(timed([PY, "-c", "import torch"], base)[1])
        for b in backends:
            for store in ("new", "existing"):
                cwd = existing if store == "existing" else base / f"new-{i}-{b}"
                cwd.mkdir(exist_ok=True)
                f, e = timed(one_round(root, b), cwd, "round 1/")
                first.setdefault((b, store), []).append(f)
                end.setdefault((b, store), []).append(e)
    yard = statistics.median(torch_s)
    print(f"python -c 'import torch'  {yard:6.2f} s (median of {repeat}: "
          f"{', '.join(f'{t:.2f}' for t in torch_s)})")
    default = re.search(r"backend:\s*(\w+)",
                        (root / "scenarios" / "quickstart.yaml").read_text())
    print("\n| one round of the quickstart | store | first round | finished |\n"
          "|---|---|---:|---:|")
    for b in backends:
        name = f"defaults ({default.group(1) if default else 'its default'})" if b is None \
            else f"--backend {b}"
        for store in ("new", "existing"):
            f, e = (statistics.median(d[(b, store)]) for d in (first, end))
            print(f"| {name} | {store} | {f:5.2f} s = {f / yard:4.2f}x | "
                  f"{e:5.2f} s = {e / yard:4.2f}x |")


def warm_pool(root: Path, base: Path, repeat: int) -> None:
    """The one-round runs on a warm pool (``fedray up``; its own XDG_RUNTIME_DIR), interleaved
    with ``import torch``: ``fedray up`` itself, the pool's first command, then medians of
    the defaults and ``--backend inline`` with a new and an existing store, and ``--backend
    ray`` with an existing one, as ratios to the yardstick's median in this series."""
    runtime = base / "runtime"
    runtime.mkdir(mode=0o700)
    env = {"XDG_RUNTIME_DIR": str(runtime), "FEDRAY_POOL": "1"}
    t0 = time.perf_counter()
    subprocess.run([*FEDRAY, "up"], cwd=base, env={**os.environ, **env,
                   "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}, check=True,
                   stdout=subprocess.DEVNULL)
    print(f"\nfedray up: {time.perf_counter() - t0:.2f} s (its imports)")
    try:
        existing = base / "pool-existing"
        existing.mkdir()
        first = timed(one_round(root, "inline"), existing, "round 1/", env)
        print(f"the pool's first command (inline, new store): round 1 at {first[0]:.2f} s, "
              f"finished at {first[1]:.2f} s")
        rows: list[tuple[str | None, str]] = [(None, "new"), (None, "existing"),
                                              ("inline", "new"), ("inline", "existing"),
                                              ("ray", "existing")]
        first_s: dict[tuple[str | None, str], list[float]] = {}
        end_s: dict[tuple[str | None, str], list[float]] = {}
        torch_s: list[float] = []
        for i in range(repeat):
            torch_s.append(timed([PY, "-c", "import torch"], base)[1])
            for b, store in rows:
                cwd = existing if store == "existing" else base / f"pool-new-{i}-{b}"
                cwd.mkdir(exist_ok=True)
                f, e = timed(one_round(root, b), cwd, "round 1/", env)
                first_s.setdefault((b, store), []).append(f)
                end_s.setdefault((b, store), []).append(e)
        yard = statistics.median(torch_s)
        print(f"python -c 'import torch'  {yard:6.2f} s (median of {repeat}: "
              f"{', '.join(f'{t:.2f}' for t in torch_s)})")
        print("\n| one round of the quickstart, on the warm pool | store | first round | "
              "finished |\n|---|---|---:|---:|")
        for b, store in rows:
            name = "defaults" if b is None else f"--backend {b}"
            f, e = (statistics.median(d[(b, store)]) for d in (first_s, end_s))
            print(f"| {name} | {store} | {f:5.2f} s = {f / yard:4.2f}x | "
                  f"{e:5.2f} s = {e / yard:4.2f}x |")
        f, e = first_s[("ray", "existing")][0], end_s[("ray", "existing")][0]
        print(f"the pool's first command on Ray (it starts Ray and the actors the later ones "
              f"reuse): round 1 at {f:.2f} s, finished at {e:.2f} s")
    finally:
        subprocess.run([*FEDRAY, "down", "--force"], cwd=base, env={**os.environ, **env},
                       check=False, stdout=subprocess.DEVNULL)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--root", type=Path, default=ROOT)
    ap.add_argument("--pool-only", action="store_true",
                    help="only the warm pool's rows (fedray up, its commands, import torch)")
    args = ap.parse_args()
    os.environ["FEDRAY_POOL"] = "0"  # the rows without a pool: not a pool the user has up
    root = args.root.resolve()
    quick = str(root / "scenarios" / "quickstart.yaml")
    with tempfile.TemporaryDirectory(prefix="fedray-startup-") as d:
        base = Path(d)
        os.environ["XDG_CACHE_HOME"] = str(base / "cache")  # the templates: the benchmark's
        if args.pool_only:
            (base / "first").mkdir()  # the store template, as the full series makes it
            timed(one_round(root, "inline"), base / "first")
            warm_pool(root, base, args.repeat)
            return
        (base / "first").mkdir()
        e = timed(one_round(root, "inline"), base / "first")[1]
        print(f"the first new store of this MLflow version (inline, one round): {e:.2f} s")
        print(f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores")
        matrix(root, base, args.repeat)
        print(f"load average {os.getloadavg()[0]:.1f}")
        warm_pool(root, base, args.repeat)
        print(f"load average {os.getloadavg()[0]:.1f}")
        one = one_round(root, "inline")
        print("\nafter the round of a one-round inline run, existing store (one instrumented "
              "run):")
        print_parts(timeline(one, base / "existing"))
        for sub in (["validate", quick], ["show", quick], ["list"]):
            s = median_of(args.repeat, [*FEDRAY, *sub], base)[1]
            mods = {name.split(".")[0] for _, _, name in importtime([*FEDRAY, *sub], base)}
            heavy = [m for m in HEAVY if m in mods]
            print(f"fedray {sub[0]:8}                 {s:6.2f} s; imports "
                  f"{', '.join(heavy) if heavy else 'none of torch, ray, mlflow'}")
        print("\nimport time of a one-round `fedray run --backend inline` (cumulative, first "
              "import of each package; MLflow's on its own thread):")
        for name, s, who in top_packages(importtime(one, base / "existing"))[:14]:
            print(f"  {name:22} {s:6.2f} s  <- {who}")


if __name__ == "__main__":
    if sys.argv[1:2] == ["--child-timeline"]:
        _child_timeline(sys.argv[2:])
    else:
        main()
