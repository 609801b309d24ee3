"""The report's privacy attacks (``privacy_attacks:``; dashboards/attacks.py): the PNG writer
on 2 x 2 images by hand, a table per attack with the run's final metrics, a reconstruction
attack's samples drawn beside the true ones (inline PNGs decoded back to the true digit), the
first seed of each sweep point drawn, and no section for a run without attacks."""

from __future__ import annotations

import base64
import html
import re
import struct
import zlib

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from mlflow.tracking import MlflowClient

from dashboards.attacks import (
    attack_kind,
    attack_metrics,
    attack_names,
    png,
    psnr_text,
    read_reconstruction,
    reconstruction_svg,
    to_pixels,
)
from dashboards.rundata import Reconstruction, RunData
from tests.stores import run_text


def decode_png(data: bytes) -> tuple[int, np.ndarray]:
    """(colour type, pixels) of an 8-bit, unfiltered, non-interlaced PNG, every chunk's CRC
    checked: the reader the tests hold ``png`` to."""
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    pos, chunks = 8, []
    while pos < len(data):
        (n,) = struct.unpack(">I", data[pos:pos + 4])
        kind, body = data[pos + 4:pos + 8], data[pos + 8:pos + 8 + n]
        (crc,) = struct.unpack(">I", data[pos + 8 + n:pos + 12 + n])
        assert crc == zlib.crc32(kind + body) & 0xFFFFFFFF
        chunks.append((kind, body))
        pos += 12 + n
    assert chunks[0][0] == b"IHDR" and chunks[-1] == (b"IEND", b"")
    w, h, depth, colour, comp, filt, interlace = struct.unpack(">IIBBBBB", chunks[0][1])
    assert (depth, comp, filt, interlace) == (8, 0, 0, 0)
    raw = zlib.decompress(b"".join(b for k, b in chunks if k == b"IDAT"))
    channels = {0: 1, 2: 3}[colour]
    lines = np.frombuffer(raw, np.uint8).reshape(h, 1 + w * channels)
    assert (lines[:, 0] == 0).all()  # no filter
    px = lines[:, 1:].reshape(h, w, channels)
    return colour, px[:, :, 0] if channels == 1 else px


# ------------------------------------------------------------ the PNG writer, by hand

def test_png_of_a_2x2_grey_image_byte_by_byte():
    data = png(np.array([[0, 255], [128, 64]], np.uint8))
    ihdr = b"\x00\x00\x00\x02" b"\x00\x00\x00\x02" b"\x08\x00\x00\x00\x00"  # 2 x 2, 8-bit grey
    scanlines = b"\x00\x00\xff" b"\x00\x80\x40"  # filter 0, then each row's bytes
    assert data == (b"\x89PNG\r\n\x1a\n"
                    + b"\x00\x00\x00\x0d" + b"IHDR" + ihdr
                    + struct.pack(">I", zlib.crc32(b"IHDR" + ihdr))
                    + struct.pack(">I", len(zlib.compress(scanlines, 9))) + b"IDAT"
                    + zlib.compress(scanlines, 9)
                    + struct.pack(">I", zlib.crc32(b"IDAT" + zlib.compress(scanlines, 9)))
                    + b"\x00\x00\x00\x00IEND\xae\x42\x60\x82")  # IEND's CRC, a constant
    assert zlib.crc32(b"IHDR" + ihdr) == 0x57DD_52F8  # the IHDR of any 2 x 2 8-bit grey PNG
    colour, px = decode_png(data)
    assert colour == 0 and px.tolist() == [[0, 255], [128, 64]]


def test_png_of_a_2x2_rgb_image_and_its_pixels_from_a_sample():
    # a 3-channel sample, channels first as the attack's table stores it: red, green, blue
    sample = [1.0, 0.0, 0.0, 0.5,  # R
              0.0, 1.0, 0.0, 0.5,  # G
              0.0, 0.0, 1.0, 2.0]  # B (2.0 above the range: clipped)
    px = to_pixels(sample, [3, 2, 2], 0.0, 1.0)
    assert px.shape == (2, 2, 3) and px.dtype == np.uint8
    assert px.tolist() == [[[255, 0, 0], [0, 255, 0]], [[0, 0, 255], [128, 128, 255]]]
    data = png(px)
    assert data[16:29] == b"\x00\x00\x00\x02\x00\x00\x00\x02\x08\x02\x00\x00\x00"  # RGB
    assert zlib.decompress(data[41:-16]) == bytes([0, 255, 0, 0, 0, 255, 0,
                                                   0, 0, 0, 255, 128, 128, 255])
    colour, back = decode_png(data)
    assert colour == 2 and back.tolist() == px.tolist()
    # grey: one channel, or (h, w); lo -> 0, hi -> 255, nan -> lo
    assert to_pixels([2.0, 4.0, 3.0, float("nan")], [1, 2, 2], 2.0, 4.0).tolist() == \
        [[0, 255], [128, 0]]
    assert to_pixels([0.25, 0.5, 0.75, 1.0], [2, 2], 0.0, 1.0).tolist() == [[64, 128], [191, 255]]
    PIL = pytest.importorskip("PIL.Image")  # an independent reader agrees
    import io

    assert np.asarray(PIL.open(io.BytesIO(data)).convert("RGB")).tolist() == px.tolist()
    with pytest.raises(ValueError, match="must be uint8"):
        png(np.zeros((2, 2)))
    with pytest.raises(ValueError, match=r"must be \(h, w\) or \(h, w, 3\)"):
        png(np.zeros((2, 2, 4), np.uint8))


def test_attack_names_and_kinds_from_what_a_run_logged():
    params = {"privacy_attacks": '[{"name": "dlg", "round": 1}, {"name": "loss_threshold"}]'}
    assert attack_names(params) == ["dlg", "loss_threshold"]
    assert attack_names({}) == attack_names({"privacy_attacks": "[]"}) == []
    assert attack_names({"privacy_attacks": '[{"name": "dlg", "ro'}) == []  # cut by MLflow
    assert "dlg_success_bound" in attack_metrics(["dlg"]) and "dlg_auc" in attack_metrics(["dlg"])
    logged = {"dlg_success_bound": 1.0, "loss_threshold_advantage_bound": 1.0}
    assert attack_kind(logged, "dlg") == "reconstruction"
    assert attack_kind(logged, "loss_threshold") == "membership"
    assert attack_kind(logged, "inverting_gradients") is None


# ------------------------------------------------------------ synthetic runs: seeds, images

def _rows(n: int, shape: list[int], seed: int) -> list[dict]:
    rng = np.random.default_rng(seed)
    size = int(np.prod(shape))
    return [{"sample": i, "client": 7, "label": i % 10, "reconstructed_label": i % 10,
             "psnr": 20.0 + i, "truth": rng.random(size).tolist(),
             "reconstruction": rng.random(size).tolist(), "shape": shape} for i in range(n)]


class FakeClient:
    """``download_artifacts`` as MLflow's: writes the run's table, records who was asked."""

    def __init__(self, tables: dict[str, list[dict]]) -> None:
        self.tables, self.asked = tables, []

    def download_artifacts(self, run_id: str, path: str, dst: str) -> str:
        self.asked.append((run_id, path))
        out = f"{dst}/{path.rsplit('/', 1)[1]}"
        pq.write_table(pa.Table.from_pylist(self.tables[run_id]), out)
        return out


def _synthetic(seed: str, success: float, psnr: float) -> RunData:
    return RunData(f"id{seed}", f"p seed={seed}", "p", seed, {},
                   {"privacy_attacks": '[{"name": "inverting_gradients"}]'},
                   {"test_accuracy": [(2, 0.5)],
                    "inverting_gradients_success": [(2, success)],
                    "inverting_gradients_success_bound": [(2, 0.75)],
                    "inverting_gradients_psnr": [(2, psnr)],
                    "inverting_gradients_ssim": [(2, 0.5)],
                    "inverting_gradients_label_accuracy": [(2, 1.0)]})


def test_seeds_averaged_the_first_seed_drawn_at_most_8_samples_in_rgb(tmp_path):
    from dashboards.export import Exports, write_figures, write_tables
    from dashboards.report import _load_reconstructions, render

    runs = [_synthetic("1", 0.5, 12.0), _synthetic("0", 1.0, 14.0)]
    client = FakeClient({"id0": _rows(10, [3, 4, 4], 0), "id1": _rows(3, [3, 4, 4], 1)})
    _load_reconstructions(client, runs)
    assert client.asked == [("id0", "privacy/attack_inverting_gradients.parquet")]
    rec = runs[1].reconstructions["inverting_gradients"]
    assert rec.total == 10 and [r["sample"] for r in rec.rows] == list(range(8))
    exports = Exports()
    text = render("t", runs, exports)
    section = text.split("<h2>Privacy attacks</h2>")[1]
    table = section.split('<table class="attack_inverting_gradients">')[1].split("</table>")[0]
    cells = [html.unescape(c.rsplit(">", 1)[1]) for c in table.split("<tbody>")[1]
             .split("</td>")[:-1]]
    assert cells == ["p", "2", "0.75 ± 0.35", "0.75 ± 0", "13 ± 1.4", "0.5 ± 0", "1 ± 0"]
    assert section.count("<image ") == 16 and section.count('<svg class="recon"') == 1
    assert "p (seed 0), client 7: the first 8 of its 10 samples" in section
    assert [html.unescape(t) for t in re.findall(r'text-anchor="middle">([^<]+)</text>',
                                                 section)] == \
        [f"{20.0 + i:.1f} dB" for i in range(8)]
    # each image a 4 x 4 RGB PNG drawn 16 times its size; truth on the truths' range
    uris = re.findall(r'href="data:image/png;base64,([^"]+)"', section)
    colour, px = decode_png(base64.b64decode(uris[0]))
    truths = np.concatenate([r["truth"] for r in rec.rows])
    assert colour == 2 and px.shape == (4, 4, 3)
    assert px.tolist() == to_pixels(rec.rows[0]["truth"], [3, 4, 4], truths.min(),
                                    truths.max()).tolist()
    assert re.search(r'<image x="[\d.]+" y="2" width="64" height="64"', section)
    # the export: the table as files; the figures unchanged by the images
    write_figures(exports, tmp_path / "figures")
    assert (write_tables(exports, tmp_path / "tables")
            and (tmp_path / "tables" / "attack_inverting_gradients.md").is_file())


def test_inputs_that_are_not_images_are_not_drawn():
    assert reconstruction_svg(Reconstruction(_rows(2, [64], 0), 2)) == ""
    assert psnr_text(123.456) == "123.5 dB" and psnr_text(1e6) == "1e+06 dB"


# ------------------------------------------------------------ a real run with attacks

ATTACKS = """\
name: attacks
rounds: 2
data: {dataset: {name: digits}, partitioner: {name: iid}}
model: {name: logreg}
clients: {total: 1438, per_round: 2}
local: {steps: 1, batch_size: 1, lr: 0.1}
privacy_attacks:
  - {name: dlg, round: 1, iterations: 100, labels: infer}
  - {name: loss_threshold}
runtime: {backend: inline}
"""


@pytest.fixture(scope="module")
def attacked(new_store):
    tmp, uri = new_store("attack-report")
    run_id = run_text(tmp, uri, ATTACKS, "a.yaml").runs[0]["run_id"]
    run_text(tmp, uri, ATTACKS.split("privacy_attacks:")[0].replace("name: attacks", "name: plain")
             + "runtime: {backend: inline}\n", "b.yaml")
    client = MlflowClient(uri)
    table = pq.read_table(client.download_artifacts(run_id, "privacy/attack_dlg.parquet",
                                                    str(tmp))).to_pylist()
    return {"uri": uri, "tmp": tmp, "final": client.get_run(run_id).data.metrics,
            "table": table}


def _table_cells(section: str, cls: str) -> list[list[str]]:
    table = section.split(f'<table class="{cls}">')[1].split("</table>")[0]
    return [[html.unescape(c.rsplit(">", 1)[1]) for c in r.split("</td>")[:-1]]
            for r in table.split("<tr>")[2:]]


def test_report_of_a_run_with_attacks(attacked):
    from dashboards.report import build_report

    final, table = attacked["final"], attacked["table"]
    assert final["dlg_psnr"] > 60 and final["dlg_success"] == 1.0  # iDLG found the digit
    text = build_report("attacks", attacked["tmp"] / "out-a", attacked["uri"]).read_text()
    section = text.split("<h2>Privacy attacks</h2>")[1]
    assert "<h3>dlg (reconstruction)</h3>" in section
    assert "<h3>loss_threshold (membership)</h3>" in section
    assert _table_cells(section, "attack_dlg") == [[
        "attacks", "1", *(f"{final['dlg_' + k]:.4g}" for k in
                          ("success", "success_bound", "psnr", "ssim", "label_accuracy"))]]
    assert _table_cells(section, "attack_loss_threshold") == [[
        "attacks", "1", *(f"{final['loss_threshold_' + k]:.4g}" for k in
                          ("advantage", "advantage_bound", "auc"))]]
    # the client's samples (a digit or two), each beside its reconstruction
    shown = table[:8]
    assert section.count("<image ") == 2 * len(shown)
    assert [html.unescape(t) for t in re.findall(r'text-anchor="middle">([^<]+)</text>',
                                                 section)] == \
        [psnr_text(r["psnr"]) for r in shown]
    uris = re.findall(r'href="data:image/png;base64,([^"]+)"', section)
    truths = np.concatenate([r["truth"] for r in shown])
    lo, hi = truths.min(), truths.max()
    for r, (t_uri, r_uri) in zip(shown, zip(uris[::2], uris[1::2])):
        colour, truth = decode_png(base64.b64decode(t_uri))
        assert colour == 0 and truth.shape == (8, 8)  # an 8 x 8 grey digit
        want = np.rint((np.reshape(r["truth"], (8, 8)) - lo) / (hi - lo) * 255)
        assert truth.tolist() == want.astype(int).tolist()
        # iDLG's reconstruction is the digit to within a grey level
        _, rec = decode_png(base64.b64decode(r_uri))
        assert np.abs(rec.astype(int) - truth.astype(int)).max() <= 1
    assert f"client {table[0]['client']}:" in section
    assert re.search(r'<image x="[\d.]+" y="2" width="64" height="64"', section)
    assert "http" not in text.replace("http://www.w3.org/2000/svg", "")  # self-contained
    assert (attacked["tmp"] / "out-a" / "tables" / "attack_dlg.md").is_file()


def test_report_of_a_run_without_attacks_has_no_attack_section(attacked):
    from dashboards.report import build_report

    text = build_report("plain", attacked["tmp"] / "out-b", attacked["uri"]).read_text()
    assert "Privacy attacks" not in text and "<image " not in text
    assert 'class="recon"' not in text and 'class="attack_' not in text
    assert not list((attacked["tmp"] / "out-b" / "tables").glob("attack_*"))


def test_read_reconstruction_reads_the_first_rows(tmp_path):
    pq.write_table(pa.Table.from_pylist(_rows(20, [1, 2, 2], 0)), tmp_path / "t.parquet")
    rec = read_reconstruction(tmp_path / "t.parquet", 3)
    assert rec.total == 20 and [r["sample"] for r in rec.rows] == [0, 1, 2]
