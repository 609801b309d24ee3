"""What the report shows of a run's privacy attacks (``privacy_attacks:``;
simulator/runtime/privacy_attacks.py): which attacks it ran (its scenario's
``privacy_attacks`` param), the metrics each logged at the last round, and a reconstruction
attack's samples drawn beside the client's true ones.

A drawn sample is a PNG at the input's own resolution (8 x 8 for a digit: about 100 bytes),
written here with zlib (no imaging library), inline in the SVG as an ``<image>`` with a
base64 ``data:`` address and scaled up by a whole factor with nearest-neighbour rendering
(``image-rendering``). A ``<rect>`` per pixel would cost about 60 bytes a pixel (4 kB for a
digit, 180 kB for a 32 x 32 colour image), and the report stays one self-contained file
either way.
"""

from __future__ import annotations

import base64
import html
import json
import math
import struct
import zlib
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from dashboards.rundata import Reconstruction
from dashboards.svg import text_width
from simulator.run.privacy_shadows import MEASURES

# the metrics an attack logs at the last round, after its name (``dlg_psnr``)
RECONSTRUCTION_METRICS = ("success", "success_bound", "psnr", "ssim", "label_accuracy")
MEMBERSHIP_METRICS = ("advantage", "advantage_bound", "auc")
# what ``fedray privacy shadows`` logs on each run of a shadow-run attack (LiRA), and the
# score's own TPR at 1 % FPR each run logs
SHADOW_METRICS = (*(f"shadows_{m}" for m in MEASURES), "tpr_at_fpr_0.01")
MAX_SAMPLES = 8  # drawn per attack and run
PER_ROW = 4  # pairs on a row of the drawing
SIDE = 64  # px: an image is scaled up by the largest whole factor that keeps it within this


def attack_names(params: Mapping[str, str]) -> list[str]:
    """The names of the privacy attacks a run's scenario lists (its ``privacy_attacks``
    param, the list as JSON); none when it lists none or the param is not a list."""
    try:
        specs = json.loads(params.get("privacy_attacks", "[]"))
    except ValueError:  # cut at MLflow's param length, or not JSON
        return []
    if not isinstance(specs, list):
        return []
    return [s["name"] for s in specs if isinstance(s, dict) and isinstance(s.get("name"), str)]


def attack_metrics(names: Sequence[str]) -> list[str]:
    """Every metric an attack of ``names`` may log (either kind's, and a shadow-run
    attack's combined measures)."""
    return [f"{n}_{m}" for n in names
            for m in RECONSTRUCTION_METRICS + MEMBERSHIP_METRICS + SHADOW_METRICS]


def attack_kind(logged: Mapping[str, Any], name: str) -> str | None:
    """``reconstruction``, ``membership`` or ``shadow runs`` (a membership attack whose runs
    ``fedray privacy shadows`` combined), by what the run logged for attack ``name``
    (``logged``: the run's metrics by name); None when it logged no bound (the run did not
    reach its last round)."""
    if f"{name}_success_bound" in logged:
        return "reconstruction"
    if f"{name}_shadows_auc" in logged:
        return "shadow runs"
    if f"{name}_advantage_bound" in logged:
        return "membership"
    return None


def read_reconstruction(path: Path | str, limit: int = MAX_SAMPLES) -> Reconstruction:
    """The first ``limit`` rows of an ``attack_<name>.parquet`` table (only those are read)
    and its row count."""
    import pyarrow.parquet as pq

    f = pq.ParquetFile(path)
    rows: list[dict[str, Any]] = []
    for batch in f.iter_batches(batch_size=limit):
        rows = batch.to_pylist()[:limit]
        break
    return Reconstruction(rows, f.metadata.num_rows)


# ---------------------------------------------------------------- images


def png(pixels: np.ndarray) -> bytes:
    """A PNG of ``pixels``, uint8, (height, width) grey or (height, width, 3) RGB: 8 bits a
    channel, no filter, one zlib stream."""
    a = np.asarray(pixels)
    if a.dtype != np.uint8:
        raise ValueError(f"pixels: must be uint8, got {a.dtype}")
    if a.ndim == 2:
        colour = 0  # grey
    elif a.ndim == 3 and a.shape[2] == 3:
        colour = 2  # RGB
    else:
        raise ValueError(f"pixels: must be (h, w) or (h, w, 3), got {a.shape}")
    h, w = a.shape[:2]
    if not h or not w:
        raise ValueError(f"pixels: empty image {a.shape}")
    # each scanline: its filter type (0, none), then its bytes
    raw = np.concatenate([np.zeros((h, 1), np.uint8), a.reshape(h, -1)], axis=1).tobytes()

    def chunk(kind: bytes, data: bytes) -> bytes:
        return (struct.pack(">I", len(data)) + kind + data
                + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF))

    return (b"\x89PNG\r\n\x1a\n"
            + chunk(b"IHDR", struct.pack(">IIBBBBB", w, h, 8, colour, 0, 0, 0))
            + chunk(b"IDAT", zlib.compress(raw, 9)) + chunk(b"IEND", b""))


def image_shape(shape: Sequence[int]) -> tuple[int, int, int] | None:
    """(channels, height, width) of a sample of ``shape`` drawn as an image: (1 or 3, h, w)
    channels first, or (h, w) grey; None for other inputs (a feature vector)."""
    s = [int(v) for v in shape]
    if len(s) == 3 and s[0] in (1, 3) and s[1] > 0 and s[2] > 0:
        return s[0], s[1], s[2]
    if len(s) == 2 and s[0] > 0 and s[1] > 0:
        return 1, s[0], s[1]
    return None


def to_pixels(values: Sequence[float], shape: Sequence[int], lo: float, hi: float
              ) -> np.ndarray:
    """A flattened sample (channels first) as uint8 pixels for ``png``: ``lo`` -> 0, ``hi``
    -> 255, linear between, clipped outside (a non-finite value reads ``lo``)."""
    dims = image_shape(shape)
    if dims is None:
        raise ValueError(f"shape: not an image, got {list(shape)}")
    c, h, w = dims
    x = np.nan_to_num(np.asarray(values, dtype=np.float64).reshape(c, h, w), nan=lo,
                      posinf=hi, neginf=lo)
    span = hi - lo if hi > lo else 1.0
    x = np.rint(np.clip((x - lo) / span, 0.0, 1.0) * 255).astype(np.uint8)
    return x[0] if c == 1 else np.ascontiguousarray(x.transpose(1, 2, 0))


def data_uri(pixels: np.ndarray) -> str:
    return "data:image/png;base64," + base64.b64encode(png(pixels)).decode("ascii")


def psnr_text(value: float) -> str:
    """A pair's PSNR as drawn under it: ``63.2 dB``."""
    if not math.isfinite(value):
        return "- dB"
    return f"{value:.1f} dB" if abs(value) < 1e4 else f"{value:.3g} dB"


def reconstruction_svg(rec: Reconstruction) -> str:
    """The samples of ``rec`` as one inline SVG: each true sample (left) beside its
    reconstruction (right), its PSNR under the pair, ``PER_ROW`` pairs a row; grey for one
    channel, RGB for three, all on one range (the shown true samples' min to max; a
    reconstruction clipped to it). Empty when the samples are not images."""
    rows = [r for r in rec.rows if image_shape(r.get("shape") or []) is not None]
    if not rows:
        return ""
    _, h, w = image_shape(rows[0]["shape"]) or (1, 1, 1)
    truth = np.concatenate([np.asarray(r["truth"], dtype=np.float64) for r in rows])
    finite = truth[np.isfinite(truth)]
    lo, hi = (float(finite.min()), float(finite.max())) if finite.size else (0.0, 1.0)
    k = max(1, SIDE // max(h, w))
    iw, ih = w * k, h * k
    cell = max(2 * iw + 2, text_width("000000.0 dB")) + 16
    row_h = ih + 22
    n_cols = min(PER_ROW, len(rows))
    n_rows = math.ceil(len(rows) / PER_ROW)
    width, height = n_cols * cell, n_rows * row_h
    out = [(f'<svg class="recon" xmlns="http://www.w3.org/2000/svg" width="{width}" '
            f'height="{height}" viewBox="0 0 {width} {height}">')]
    for i, r in enumerate(rows):
        x0 = (i % PER_ROW) * cell + (cell - 16 - (2 * iw + 2)) / 2
        y0 = (i // PER_ROW) * row_h + 2
        hover = (f"sample {r.get('sample')}: label {r.get('label')}, reconstructed "
                 f"{r.get('reconstructed_label')}, PSNR {psnr_text(float(r['psnr']))}")
        out.append(f"<g><title>{html.escape(hover)}</title>")
        for j, values in enumerate((r["truth"], r["reconstruction"])):
            uri = data_uri(to_pixels(values, r["shape"], lo, hi))
            out.append(f'<image x="{x0 + j * (iw + 2):.1f}" y="{y0}" width="{iw}" '
                       f'height="{ih}" preserveAspectRatio="none" '
                       f'image-rendering="optimizeSpeed" href="{uri}"/>')
        out.append(f'<text class="tick" x="{x0 + iw + 1:.1f}" y="{y0 + ih + 14}" '
                   f'text-anchor="middle">{html.escape(psnr_text(float(r["psnr"])))}</text></g>')
    out.append("</svg>")
    return "".join(out)
