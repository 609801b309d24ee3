"""``runtime.deterministic: strict``: the same bits on any x86-64 machine.

What moves a run's numbers between two x86 machines with the same torch build is which
kernels torch picks for the instruction set and vendor it finds (measured on this project's
AMD EPYC with AVX-512, a 30-round CNN on MNIST, 2 seeds, Krum under sign flipping: the final
accuracy was 0.657 ± 0.050 as found, 0.692 with ATen's AVX2 kernels, 0.538 with oneDNN held
to AVX2, 0.692 with MKL's compatible path; docs/performance.md, "Reproducible on any
machine"). Three families decide:

* ATen's own vectorised kernels (reductions, element-wise maths) dispatch on the CPU's
  capability (default, AVX2, AVX-512): ``ATEN_CPU_CAPABILITY=default`` takes the portable
  build, read when the first kernel is dispatched;
* MKL's BLAS (every fp32 ``Linear``, ``matmul``, and ``conv`` once oneDNN is off) takes a
  code path per instruction set and vendor: ``MKL_CBWR=COMPATIBLE`` is Intel's Conditional
  Numerical Reproducibility mode that gives the same results on every Intel and compatible
  x86 processor, read when MKL starts;
* oneDNN (convolutions) generates code per instruction set and picks its blocking from the
  caches' sizes: it is switched off (``torch.backends.mkldnn.enabled = False``, convolutions
  then go through ATen's im2col and MKL), and held to SSE4.1 for anything else
  (``ONEDNN_MAX_CPU_ISA``);
* numpy dispatches its maths (exp, log, tanh...) on the CPU's features above its x86-64-v2
  baseline, and the results differ in the last bits (measured here: float32 exp of 10^7
  normal samples); ``NPY_DISABLE_CPU_FEATURES`` lists every feature it dispatches on, read
  when numpy is imported.

Checked on this machine: glibc's maths functions with its FMA/AVX2 variants masked
(``GLIBC_TUNABLES=glibc.cpu.hwcaps=-AVX2,-FMA,-AVX512F``) give the same bits for exp, log and
tanh under the portable ATen build, so libm needs no pin. Threads are one per process by
default (``runtime.threads``) already.

numpy reads its variable when it is imported, ATen and MKL theirs when they first run: a
process must start with :data:`PINNED_ENV` in its environment. ``fedray run``, ``tune`` and
``resume`` restart themselves with it when a run they compute in this process asks for
``strict`` (``fedray.cli``; ``fedray sweep``'s points are Ray tasks); Ray actors and tasks get
it as their ``runtime_env`` (a fresh worker process); every process that computes a
run's numbers calls :func:`pin_kernels`, which checks that the kernels really are the pinned
ones and otherwise stops the run in one line (:class:`KernelsNotPinned`).
"""

from __future__ import annotations

import ctypes
import importlib
import os
from pathlib import Path

import torch

from simulator.errors import FedrayError
from simulator.pinning import NUMPY_DISPATCH, PINNED_ENV

MKL_CBWR_BRANCH = 1  # mkl_cbwr_get's argument: the code branch
MKL_CBWR_COMPATIBLE = 3  # its answer in the compatible mode (mkl_cbwr.h)


class KernelsNotPinned(FedrayError):
    """A process asked for ``strict`` had chosen its torch kernels before it could pin them."""


def _mkl_branch() -> int | None:
    """MKL's code branch in this process (``mkl_cbwr_get``), or None for a torch built
    without MKL (its BLAS then has no per-CPU branch to pin)."""
    lib = Path(torch.__file__).parent / "lib" / "libtorch_cpu.so"
    try:
        get = ctypes.CDLL(str(lib)).mkl_serv_cbwr_get
    except (OSError, AttributeError):
        return None
    get.argtypes, get.restype = [ctypes.c_int], ctypes.c_int
    return int(get(MKL_CBWR_BRANCH))


def _numpy_features() -> str:
    features = importlib.import_module("numpy._core._multiarray_umath").__cpu_features__
    return ",".join(f for f in NUMPY_DISPATCH if features.get(f)) or "baseline"


def kernels_pinned() -> bool:
    """Whether this process runs the pinned kernels (dispatching ATen's capability here if
    nothing has yet: call it after :func:`pin_kernels` has set the environment)."""
    branch = _mkl_branch()
    return (_numpy_features() == "baseline"
            and torch.backends.cpu.get_cpu_capability() == "DEFAULT"
            and (branch is None or branch == MKL_CBWR_COMPATIBLE)
            and not torch.backends.mkldnn.enabled)


def pin_kernels() -> None:
    """Pin this process's kernels (module docstring) and check that they are pinned; raise
    :class:`KernelsNotPinned` in one line if the process chose its kernels before (numpy's
    are chosen at its import: only a process started with :data:`PINNED_ENV` passes), and
    leave its environment and oneDNN as they were then."""
    before = {k: os.environ.get(k) for k in PINNED_ENV}
    onednn = torch.backends.mkldnn.enabled
    os.environ.update(PINNED_ENV)  # read by ATen and MKL when they first run, if not yet
    torch.backends.mkldnn.set_flags(False)
    if kernels_pinned():
        return
    for k, v in before.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v
    torch.backends.mkldnn.set_flags(onednn)
    raise KernelsNotPinned(
        "runtime.deterministic: strict: this process chose its kernels (torch's, numpy's) "
        f"before it could pin them (ATen {torch.backends.cpu.get_cpu_capability()}, MKL "
        f"branch {_mkl_branch()}, numpy {_numpy_features()}); run it with the fedray command "
        "(it restarts itself pinned) or start Python with "
        + " ".join(f"{k}={v}" for k, v in PINNED_ENV.items()))
