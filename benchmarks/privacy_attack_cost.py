"""What a reconstruction attack costs in seconds per iteration: DLG (``labels: infer``, i.e.
iDLG) and Inverting Gradients (``strategies.privacy_attacks``) against every built-in value
model registered in the ``models`` kind (``simulator.registry.available("models")``; token
models such as char_lstm, and models whose constructor needs more than ``input_shape`` and
``num_classes``, are skipped and said), each with its default keys, on the CPU.

    python benchmarks/privacy_attack_cost.py [--iterations 10] [--warmup 2] [--repeats 3]
        [--threads 1] [--budget 60] [--models logreg,mlp,...] [--input simple_cnn=1x28x28]

Each model is built at a typical input for it (10 classes): logreg and mlp at scikit-learn's
digits (``simulator.data``: 1 x 8 x 8), cnn and femnist_cnn at MNIST's 1 x 28 x 28,
simple_cnn (pfl-research's CIFAR-10 model, its docstring's shape), resnet18 and resnet20 at
CIFAR's 3 x 32 x 32; a model registered later is tried at 1 x 28 x 28, 3 x 32 x 32, then
1 x 8 x 8, the first it accepts (``--input NAME=CxHxW``, repeatable, sets a model's). Weights seeded (``build_model``, seed 0), put in eval mode
as the engine gives the attacks their model (a model with BatchNorm, resnet18/20 by default,
then uses its running statistics). The target: one random sample uniform in [0, 1], a random
label, its one-step full-batch SGD update at lr 0.1 (``simulated_update``); the attack view
says 1 sample, lr 0.1, 1 step, input range (0, 1).

Timed: ``dlg(view, generator, iterations, lr=1.0, labels="infer")`` and
``inverting_gradients(view, generator, iterations, lr=0.1, tv=1e-4, restarts=1)`` (the
attacks' defaults but the budget), after one untimed call of ``--warmup`` iterations each;
wall time (``time.perf_counter``) of the whole call divided by the iterations it ran (DLG:
L-BFGS function evaluations, counted on the model's forward calls, since L-BFGS may stop
before its budget; IG: Adam steps), best of ``--repeats``. A model whose time so far passes
``--budget`` seconds gets no further repeats (at least one each; the table says how many).
One iteration is one simulated update (forward, backward with the graph kept) and its
backward, so seconds per iteration times an attack's budget (DLG 300, IG 1000 by default;
Geiping et al. use 24,000 per restart) is the attack's cost on one client's update.
``torch.set_num_threads(--threads)``, 1 by default.
"""

from __future__ import annotations

import argparse
import inspect
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

DIGITS = ((1, 8, 8), "digits")
MNIST = ((1, 28, 28), "MNIST")
CIFAR = ((3, 32, 32), "CIFAR")
TYPICAL = {"logreg": DIGITS, "mlp": DIGITS, "cnn": MNIST, "femnist_cnn": MNIST,
           "simple_cnn": CIFAR, "resnet18": CIFAR, "resnet20": CIFAR}
FALLBACK = (MNIST, CIFAR, DIGITS)
CLASSES = 10
LR = 0.1
CONTEXT = {"input_shape", "num_classes"}


def models(only: list[str] | None) -> tuple[list[str], list[str]]:
    """(names to measure, "name: why not" for the skipped ones)."""
    from simulator import registry

    names, skipped = [], []
    for name in registry.available("models"):
        if only is not None and name not in only:
            continue
        cls = registry.get("models", name)
        if cls.traits.tokens:
            skipped.append(f"{name}: a token model (takes token ids, not values)")
            continue
        params = inspect.signature(cls.__init__).parameters.values()
        needs = [p.name for p in params if p.name != "self" and p.name not in CONTEXT
                 and p.default is inspect.Parameter.empty
                 and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
        extra = [k for k in cls.traits.context if k not in CONTEXT]
        if needs or extra:
            skipped.append(f"{name}: its constructor needs {', '.join(needs or extra)}")
            continue
        names.append(name)
    return names, skipped


def build(name: str, inputs: dict[str, tuple[int, ...]]):
    """(model in eval mode, input shape, the input's label), at the model's typical input
    or the first fallback shape it accepts."""
    from simulator.models import build_model

    if name in inputs:  # asked for: no other shape
        tries = [(inputs[name], "--input")]
    else:
        tries = [TYPICAL[name]] if name in TYPICAL else []
        tries += [t for t in FALLBACK if t not in tries]
    errors = []
    for shape, label in tries:
        try:
            model = build_model({"name": name}, shape, CLASSES, seed=0)
        except (ValueError, RuntimeError) as e:
            errors.append(f"{'x'.join(map(str, shape))}: {e}")
            continue
        return model.eval(), shape, label
    raise ValueError("; ".join(errors))


def measure(name: str, args) -> dict:
    import torch

    from strategies.privacy_attacks import dlg, inverting_gradients, simulated_update
    from strategies.protocols import AttackView

    t_model = time.perf_counter()
    model, shape, label = build(name, args.input)
    g = torch.Generator().manual_seed(args.seed)
    x = torch.rand((1, *shape), generator=g)
    y = torch.nn.functional.one_hot(torch.randint(CLASSES, (1,), generator=g),
                                    CLASSES).to(torch.float32)
    update = simulated_update(model, x, y, LR, 1).detach()
    view = AttackView(model=model, update=update, samples=1, lr=LR, steps=1,
                      input_shape=tuple(shape), num_classes=CLASSES, input_range=(0.0, 1.0))

    calls = [0]

    def count(_module, _inputs):
        calls[0] += 1

    model.register_forward_pre_hook(count)
    attacks = {
        "dlg": lambda n: dlg(view, torch.Generator().manual_seed(1), n, 1.0, "infer"),
        "ig": lambda n: inverting_gradients(view, torch.Generator().manual_seed(1), n,
                                            0.1, 1e-4, 1),
    }
    out = {"params": sum(p.numel() for p in model.parameters()), "shape": shape,
           "label": label, "batchnorm": any(isinstance(m, torch.nn.modules.batchnorm._BatchNorm)
                                            for m in model.modules())}
    for key, run in attacks.items():
        run(args.warmup)
        times = []
        while not times or (len(times) < args.repeats
                            and time.perf_counter() - t_model < args.budget):
            calls[0] = 0
            t0 = time.perf_counter()
            run(args.iterations)
            dt = time.perf_counter() - t0
            times.append(dt / max(calls[0], 1))  # one forward call per iteration (1 step)
        out[key] = (min(times), len(times), calls[0])
    out["total"] = time.perf_counter() - t_model
    return out


def report(rows: list[tuple[str, dict]], skipped: list[str], args, load0: float,
           total: float) -> None:
    import torch

    print(f"(load average at the start: {load0:.1f})\n")
    print(f"One sample uniform in [0, 1], its one-step update at lr 0.1, 10 classes; each attack "
          f"{args.iterations} iterations after {args.warmup} warm-up; best of {args.repeats}; "
          f"torch {torch.__version__}, {torch.get_num_threads()} threads, "
          f"{os.cpu_count()} CPUs\n")
    print("| model | parameters | input | DLG s/iteration | Inverting Gradients s/iteration |")
    print("|---|---:|---|---:|---:|")

    def cell(v: tuple[float, int, int]) -> str:
        sec, k, n = v
        notes = []
        if k < args.repeats:
            notes.append(f"best of {k}")
        if n < args.iterations:
            notes.append(f"{n} evaluations")
        return f"{sec:.4f}" + (f" ({', '.join(notes)})" if notes else "")

    for name, r in rows:
        shape = "x".join(map(str, r["shape"]))
        bn = ", BatchNorm (eval)" if r["batchnorm"] else ""
        print(f"| {name}{bn} | {r['params']:,} | {shape} ({r['label']}) | {cell(r['dlg'])} | "
              f"{cell(r['ig'])} |")
    print()
    for name, r in rows:
        if r["total"] > args.budget:
            print(f"{name} took {r['total']:.0f} s in all (over the {args.budget:.0f} s budget)")
    for s in skipped:
        print(f"not measured: {s}")
    print(f"\nall models: {total:.0f} s; (load average at the end: {os.getloadavg()[0]:.1f})")
    scale = [f"{name} {r['dlg'][0] * 300:.0f} s / {r['ig'][0] * 1000:.0f} s"
             for name, r in rows]
    if scale:
        print("at the attacks' default budgets (DLG 300, IG 1000 iterations): "
              + "; ".join(scale))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--iterations", type=int, default=10,
                    help="each timed call's budget (DLG: L-BFGS evaluations, IG: Adam steps)")
    ap.add_argument("--warmup", type=int, default=2, help="iterations of one untimed call")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1, help="torch.set_num_threads")
    ap.add_argument("--budget", type=float, default=60.0,
                    help="seconds a model may take before its repeats stop (one at least)")
    ap.add_argument("--models", default=None, help="comma separated (default: all value models)")
    ap.add_argument("--seed", type=int, default=0, help="the target sample and label")
    ap.add_argument("--input", action="append", default=[], metavar="NAME=CxHxW",
                    help="a model's input shape (default: its typical input)")
    args = ap.parse_args()
    args.input = {k: tuple(int(v) for v in shape.split("x"))
                  for k, shape in (item.split("=", 1) for item in args.input)}

    import torch

    torch.set_num_threads(args.threads)
    only = args.models.split(",") if args.models else None
    names, skipped = models(only)
    load0 = os.getloadavg()[0]
    t_all = time.perf_counter()
    rows = []
    for name in names:
        try:
            r = measure(name, args)
        except (ValueError, RuntimeError, TypeError) as e:
            skipped.append(f"{name}: {type(e).__name__}: {e}")
            continue
        print(f"{name}: {r['total']:.1f} s", file=sys.stderr, flush=True)
        rows.append((name, r))
    total = time.perf_counter() - t_all

    report(rows, skipped, args, load0, total)


if __name__ == "__main__":
    main()
