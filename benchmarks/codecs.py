"""What a codec costs in seconds: encode and decode of one round's messages for every codec
registered in the ``codecs`` kind (``simulator.registry.available("codecs")``, so a codec
installed later is measured without a change here), against the identity, on an ``(n, d)``
float32 matrix (seeded normal entries): n = 10 clients, d = 1,000,000 (one 1000 x 1000 layer
as the message's shape, for a codec that compresses each layer as a matrix).

    python benchmarks/codecs.py [--clients 10] [--layers 1000x1000] [--repeats 3] [--no-round]

Each codec is built with its defaults (``registry.instantiate``); a codec that takes
``error_feedback`` is measured without and with it (with it: the clients' residuals from
one earlier encode, so the timed encode adds a residual as a steady round does). Encode:
``strategies.codecs.encode_chain`` (one CodecBatch, one seeded ``torch.Generator`` a row);
decode: ``decode_chain`` of that payload; best of ``--repeats``. Payload bytes per client:
the codec's declared ``chain_bytes`` (checked against the arrays encode returned).

For scale, one steady round of ``make bench-flower``'s heavy workload (benchmarks/vs_flower.py:
200 clients, 20 a round, MLP [1024], d = 73,754; fedray on Ray with 2 workers, the median of
rounds 3-5 of one run); ``--no-round`` skips it.
"""

from __future__ import annotations

import argparse
import inspect
import math
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
for p in (ROOT, ROOT / "benchmarks"):
    if str(p) not in sys.path:
        sys.path.insert(0, str(p))


def variants() -> list[tuple[str, dict]]:
    """(label, spec) of every registered codec with its defaults, and with
    ``error_feedback: true`` where its constructor takes that key."""
    from simulator import registry

    out: list[tuple[str, dict]] = []
    for name in registry.available("codecs"):
        cls = registry.get("codecs", name)
        where = Path(inspect.getsourcefile(cls) or "").resolve()
        if cls.__module__.split(".")[0] in ("strategies", "simulator") and \
                not where.is_relative_to(ROOT):
            # fedray's own module, found in another checkout (an editable install's finder
            # serves what this tree lacks): not this tree's codec
            print(f"skipped {name}: {where} is not in this checkout ({ROOT})", file=sys.stderr)
            continue
        out.append((name, {"name": name}))
        if "error_feedback" in inspect.signature(cls.__init__).parameters:
            out.append((f"{name}, error feedback", {"name": name, "error_feedback": True}))
    return out


def best(fn, repeats: int) -> tuple[float, object]:
    times, out = [], None
    for _ in range(repeats):
        t0 = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - t0)
    return min(times), out


def measure(codec, rows, shape, repeats: int) -> tuple[float, float, float, int, int]:
    """(encode s, decode s, the server's combine s (secure aggregation: masking, summing
    and unmasking the groups), declared bytes a client, the payload's bytes a client)."""
    import torch

    from strategies.codecs import chain_bytes, decode_chain, encode_chain

    n = rows.shape[0]
    chain = [codec] if codec is not None else []

    def generators():
        return [[torch.Generator().manual_seed(1000 * i + c) for c in range(n)]
                for i in range(len(chain))]

    keeps = any(c.keeps_state() for c in chain)
    states = [[{} for _ in range(n)] for _ in chain] if keeps else None
    if keeps:  # one round before: the residuals a steady round adds
        encode_chain(chain, rows, 0, shape, generators(), states)

    def encode():
        gens = generators()
        copy = [[dict(s) for s in per] for per in states] if states is not None else None
        return encode_chain(chain, rows, 1, shape, gens, copy)

    enc, parts = best(encode, repeats)
    dec, dense = best(lambda: decode_chain(chain, parts, shape), repeats)
    assert dense.shape == rows.shape, (dense.shape, rows.shape)
    comb = best(lambda: codec.combine(dense, 1, 0), repeats)[0] \
        if codec is not None and codec.hides_rows() else 0.0
    actual = sum(int(v.numel() * v.element_size()) for v in parts.values()) // n
    extra = sum(c.extra_bytes(shape, n) for c in chain)
    return enc, dec, comb, chain_bytes(chain, shape, n), actual + extra


def heavy_round() -> tuple[float, int] | None:
    """One steady round of bench-flower's heavy workload (median of rounds 3-5), seconds."""
    import json
    import subprocess
    import tempfile

    from message_path import CHILD
    from vs_flower import SCENARIO, WORKLOADS

    samples, part, hidden, clients, per_round = WORKLOADS["heavy"]
    text = SCENARIO.format(rounds=5, samples=samples, partitioner=part, hidden=hidden,
                           clients=clients, per_round=per_round, vectorize="false")
    env = {**os.environ, "PYTHONPATH": str(ROOT), "RAY_ADDRESS": "local"}
    with tempfile.TemporaryDirectory() as tmp:
        done = subprocess.run([sys.executable, "-c", CHILD, text, "2"], cwd=tmp, env=env,
                              capture_output=True, text=True, timeout=300, check=False)
    if done.returncode:
        print(f"(the heavy workload's round: exit {done.returncode}: "
              f"{done.stderr.strip().splitlines()[-1:]})")
        return None
    seconds = json.loads(done.stdout.strip().splitlines()[-1])
    return statistics.median(seconds), len(seconds)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--clients", type=int, default=10)
    ap.add_argument("--layers", default="1000x1000",
                    help="the message's parameter shapes, comma separated (d: their numel)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--no-round", action="store_true", help="skip the heavy workload's round")
    args = ap.parse_args()

    import torch

    from simulator import registry
    from strategies.protocols import MessageShape

    shapes = tuple(tuple(int(x) for x in s.split("x")) for s in args.layers.split(","))
    d = sum(math.prod(s) for s in shapes)
    shape = MessageShape(d, shapes)
    n = args.clients
    rows = torch.randn(n, d, generator=torch.Generator().manual_seed(0))

    results = [("identity (no codec)", *measure(None, rows, shape, args.repeats))]
    skipped = []
    for label, spec in variants():
        try:
            codec = registry.instantiate("codecs", spec)
            codec.check(n)
            results.append((label, *measure(codec, rows, shape, args.repeats)))
        except (TypeError, ValueError, RuntimeError, KeyError, registry.BadPlugin) as e:
            # built with its defaults and given the plain rows, it does not run: said, not hidden
            skipped.append(f"{label}: {type(e).__name__}: {e}")

    print(f"(load average at the start: {os.getloadavg()[0]:.1f})\n")
    print(f"n = {n} clients, d = {d:,} (layers {', '.join('x'.join(map(str, s)) for s in shapes)}), "
          f"float32 normal entries (seed 0); best of {args.repeats}; torch "
          f"{torch.__version__}, {torch.get_num_threads()} threads, {os.cpu_count()} CPUs\n")
    print("| codec | encode s | decode s | server combine s | total s | bytes per client | "
          "ratio to identity |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    ident = results[0][4]
    for label, enc, dec, comb, declared, actual in results:
        mark = "" if declared == actual else f" (arrays: {actual:,})"
        print(f"| {label} | {enc:.4f} | {dec:.4f} | {comb:.4f} | {enc + dec + comb:.4f} | "
              f"{declared:,}{mark} | {declared / ident:.4f} |")
    for s in skipped:
        print(f"\nnot measured: {s}")
    if not args.no_round:
        got = heavy_round()
        if got is not None:
            sec, k = got
            print(f"\nFor scale: one steady round of `make bench-flower`'s heavy workload "
                  f"(20 clients of 300 samples, MLP [1024], d = 73,754; Ray, 2 workers; "
                  f"median of {k} rounds): {sec:.3f} s")
    print(f"\n(load average at the end: {os.getloadavg()[0]:.1f})")


if __name__ == "__main__":
    main()
