"""Regenerate the tables of numbers in docs/ from the commands written beside them.

A table in a docs page sits between two marker comments:

    <!-- table ID: SCENARIO.yaml [--set KEY=VALUE ...] [--shadows] --by KEY ... [fedray table options] -->
    ...
    <!-- end table -->

    <!-- output ID: python benchmarks/SCRIPT.py [ARGS] -->
    ...
    <!-- end output -->

A ``table`` block is a sweep: its scenario file (with the ``--set`` overrides) is run into a
fresh local MLflow store (a temporary ``sqlite:///`` URI) and ``fedray table EXPERIMENT
--by ... --format markdown`` is read from that store (with ``--shadows``, after ``fedray privacy
shadows EXPERIMENT`` has combined the runs of its shadow-run attack). An ``output`` block is what a
benchmark script prints. Everything between the markers is rewritten: the exact commands
(a code block), the seeds, and the table; the prose around the markers is left alone. Blocks
of one page that share a sweep (same scenario file and overrides) share its store.

    python benchmarks/docs_tables.py docs/datasets.md [ID ...] [--runner sweep|inline]
                                     [--parallel N] [--store DIR] [--check]

``--runner sweep`` (the default) runs ``fedray sweep``'s code (``simulator.run.runner.run_sweep``,
points in parallel Ray tasks); ``inline`` runs the points one after another in this process
(``fedray run --backend inline``): the numbers are the same, by the engine's contract.
``--store DIR`` keeps the stores in DIR (``DIR/ID.db``) instead of a temporary folder, so an
interrupted regeneration resumes where it stopped (a sweep skips its FINISHED points).
``--check`` rewrites nothing: it exits 1 naming each block whose regenerated text differs
from the page.

``make docs-tables`` runs it once per block. ``tests/test_docs_tables.py`` recomputes one
cell of each table through ``block_table`` below.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import logging
import os
import re
import shlex
import subprocess
import sys
import tempfile
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as a script from anywhere: the repository's packages
    sys.path.insert(0, str(ROOT))

MARKER = re.compile(
    r"<!-- (?P<kind>table|output) (?P<id>[\w.-]+): (?P<spec>.*?) -->\n"
    r"(?P<body>.*?)"
    r"<!-- end (?P=kind) -->",
    re.DOTALL,
)
URI_NOTE = "export MLFLOW_TRACKING_URI=sqlite:///$(mktemp -d)/mlflow.db   # a fresh store"


@dataclass(frozen=True)
class Block:
    """One marked block of a page: ``kind`` table or output, its ``id``, the ``spec`` after
    the colon (the command's arguments), and where its body lies in the page's text."""

    kind: str
    id: str
    spec: str
    start: int  # of the body
    end: int

    @property
    def args(self) -> list[str]:
        return shlex.split(self.spec)

    def sweep_args(self) -> tuple[str, list[str], list[str]]:
        """(scenario file, its ``--set`` values, the ``fedray table`` arguments)."""
        args = self.args
        scenario, rest = args[0], args[1:]
        sets: list[str] = []
        table: list[str] = []
        i = 0
        while i < len(rest):
            if rest[i] == "--set":
                sets.append(rest[i + 1])
                i += 2
            elif rest[i] == "--shadows":
                i += 1
            else:
                table.append(rest[i])
                i += 1
        return scenario, sets, table

    @property
    def shadows(self) -> bool:
        """Whether the table reads what ``fedray privacy shadows`` logs on the runs."""
        return "--shadows" in self.args


def blocks(text: str) -> list[Block]:
    """The marked blocks of a page's ``text``, in order; an id used twice is refused."""
    out = [Block(m["kind"], m["id"], m["spec"], m.start("body"), m.end("body"))
           for m in MARKER.finditer(text)]
    ids = [b.id for b in out]
    twice = sorted({i for i in ids if ids.count(i) > 1})
    if twice:
        raise ValueError(f"table ids used twice: {', '.join(twice)}")
    return out


# what a table says of another machine (docs/performance.md, "Reproducible on any machine")
STRICT_NOTE = ("`runtime.deterministic: strict`: the same digits on any x86-64 machine")
MACHINE_NOTE = ("on another machine the last digits may differ: "
                "[why](performance.md#reproducible-on-any-machine)")


def load(scenario: str, sets: Sequence[str]):  # -> LoadedScenario
    from simulator.config import ScenarioError
    from simulator.config.load import load as load_scenario

    try:
        return load_scenario(str(ROOT / scenario), list(sets))
    except ScenarioError as e:
        raise SystemExit("\n".join(e.lines)) from None


def run_points(scenario: str, sets: Sequence[str], uri: str, runner: str,
               parallel: int | None) -> None:
    """Every point of ``scenario`` (with ``sets``) into the store ``uri``; a point that
    fails stops the regeneration (a table of the others would be silently short)."""
    from simulator.pinning import environment_pinned

    loaded = load(scenario, sets)
    strict = any(p.scenario.runtime.strict for p in loaded.points)
    if runner == "inline" and strict and not environment_pinned():
        # a strict point runs in a process started pinned: `fedray run` restarts itself so
        args = [a for s in sets for a in ("--set", s)]
        done = subprocess.run([sys.executable, "-m", "fedray", "run", str(ROOT / scenario), *args,
                               "--backend", "inline", "--tracking-uri", uri, "--quiet"],
                              cwd=ROOT, capture_output=True, text=True, check=False,
                              env={**os.environ, "PYTHONPATH": str(ROOT)})
        if done.returncode:
            raise SystemExit(f"{scenario}: exit {done.returncode}\n{done.stderr[-2000:]}")
        return
    if runner == "inline":
        from simulator.run.runner import run_loaded

        out = run_loaded(loaded, "inline", None, uri, quiet=True)
        failed = out.unfinished
    else:
        from simulator.run.runner import run_sweep

        out = run_sweep(loaded, None, uri, parallel)
        failed = out.failed + list(out.unfinished)
    if failed:
        raise SystemExit(f"{scenario}: points did not finish: {failed}")


def table_text(experiment: str, table_args: Sequence[str], uri: str) -> str:
    """``fedray table EXPERIMENT TABLE_ARGS --format markdown --tracking-uri URI``'s output."""
    from dashboards.tables import main as table_main

    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        rc = table_main([experiment, *table_args, "--format", "markdown", "--tracking-uri", uri])
    if rc:
        raise SystemExit(f"fedray table {experiment} {shlex.join(table_args)}: exit {rc}")
    return buf.getvalue().strip()


def block_table(block: Block, uri: str, runner: str = "sweep", parallel: int | None = None,
                extra_sets: Sequence[str] = (), run: bool = True) -> str:
    """A ``table`` block's table: its sweep (plus ``extra_sets``, e.g. one cell of it) run
    into ``uri``, then ``fedray table``. ``run=False``: the table of what ``uri`` holds."""
    scenario, sets, table_args = block.sweep_args()
    name = load(scenario, [*sets, *extra_sets]).scenario.name
    if run:
        run_points(scenario, [*sets, *extra_sets], uri, runner, parallel)
        if block.shadows:
            from simulator.run.privacy_shadows import shadow_groups

            shadow_groups([name], uri)
    return table_text(name, table_args, uri)


def sweep_body(block: Block, table: str) -> str:
    """What goes between a ``table`` block's markers: the commands, the seeds, the table."""
    scenario, sets, table_args = block.sweep_args()
    loaded = load(scenario, sets)
    sc = loaded.scenario
    sweep = shlex.join(["fedray", "sweep", scenario] + [a for s in sets for a in ("--set", s)])
    tab = shlex.join(["fedray", "table", sc.name, *table_args])
    if block.shadows:
        tab = shlex.join(["fedray", "privacy", "shadows", sc.name]) + "\n" + tab
    seeds = ", ".join(str(s) for s in sc.seeds)
    n = len(loaded.points)
    swept = any("rounds" in p.values for p in loaded.points)
    rounds = "" if swept else f", {sc.rounds} rounds"
    strict = all(p.scenario.runtime.strict for p in loaded.points)
    return (f"```\n{URI_NOTE}\n{sweep}\n{tab}\n```\n\n"
            f"({n} run{'s' if n != 1 else ''}, seeds {seeds}{rounds}; "
            f"regenerated by `make docs-tables`; {STRICT_NOTE if strict else MACHINE_NOTE})"
            f"\n\n{table}\n\n")


def output_body(block: Block) -> str:
    """What goes between an ``output`` block's markers: the command and what it printed
    (in a code block, unless it prints Markdown tables)."""
    args = block.args
    if args[:1] == ["python"]:
        args = [sys.executable, *args[1:]]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run(args, cwd=ROOT, env=env, capture_output=True, text=True, check=False)
    if done.returncode:
        raise SystemExit(f"{block.spec}: exit {done.returncode}\n{done.stderr[-2000:]}")
    out = done.stdout.strip()
    if not any(line.startswith("|") for line in out.splitlines()):
        out = f"```\n{out}\n```"  # plain lines as printed; Markdown tables render as tables
    return f"```\n{block.spec}\n```\n\n(regenerated by `make docs-tables`)\n\n{out}\n\n"


@contextlib.contextmanager
def stores(keep: str | None) -> Iterator[Path]:
    """The folder of this regeneration's stores: DIR, or a temporary one removed after."""
    if keep:
        Path(keep).mkdir(parents=True, exist_ok=True)
        yield Path(keep)
        return
    with tempfile.TemporaryDirectory(prefix="fedray-docs-tables-") as tmp:
        yield Path(tmp)


def regenerate(page: Path, ids: Sequence[str], runner: str, parallel: int | None,
               keep: str | None) -> tuple[str, list[str]]:
    """The page's text with the chosen blocks (all without ``ids``) regenerated, and the
    ids of those whose text changed."""
    text = page.read_text()
    found = blocks(text)
    unknown = sorted(set(ids) - {b.id for b in found})
    if unknown:
        raise SystemExit(f"{page}: no block {', '.join(unknown)}; blocks: "
                         f"{', '.join(b.id for b in found) or 'none'}")
    chosen = [b for b in found if not ids or b.id in ids]
    bodies: dict[str, str] = {}
    with stores(keep) as folder:
        shared: dict[tuple[str, ...], str] = {}  # a sweep's (scenario, sets) -> its store
        for b in chosen:
            if b.kind == "output":
                bodies[b.id] = output_body(b)
                continue
            scenario, sets, _ = b.sweep_args()
            key = (scenario, *sets)
            ran = key in shared
            uri = shared.setdefault(key, f"sqlite:///{(folder / (b.id + '.db')).resolve()}")
            bodies[b.id] = sweep_body(b, block_table(b, uri, runner, parallel, run=not ran))
    # the page as it is now: edited around the blocks while the sweeps ran, or another
    # block of it rewritten by a concurrent regeneration, it keeps those edits
    text = page.read_text()
    now = [b for b in blocks(text) if b.id in bodies]
    changed = [b.id for b in now if text[b.start:b.end] != bodies[b.id]]
    for b in sorted(now, key=lambda b: b.start, reverse=True):
        text = text[:b.start] + bodies[b.id] + text[b.end:]
    return text, changed


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("page", type=Path, help="a docs page, e.g. docs/datasets.md")
    ap.add_argument("ids", nargs="*", help="the blocks to regenerate (default: all)")
    ap.add_argument("--runner", choices=["sweep", "inline"], default="sweep")
    ap.add_argument("--parallel", type=int, default=None, help="points at once (sweep)")
    ap.add_argument("--store", default=None, help="keep the MLflow stores in this folder")
    ap.add_argument("--check", action="store_true", help="compare only; exit 1 on a difference")
    a = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    text, changed = regenerate(a.page, a.ids, a.runner, a.parallel, a.store)
    if a.check:
        for i in changed:
            print(f"{a.page}: block {i} differs from its regeneration", file=sys.stderr)
        return 1 if changed else 0
    a.page.write_text(text)
    print(f"{a.page}: {len(changed)} block(s) changed" + (f": {', '.join(changed)}"
                                                          if changed else ""))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
