"""The numbers in docs/ come from the commands written beside them: for each table that
`make docs-tables` regenerates, one cell is recomputed here through the same code
(benchmarks/docs_tables.py: the block's scenario file and `--set`s, restricted to the cell's
point by one more `--set sweep=...`, run into a fresh store, then `fedray table`) and must
equal what the page says. The points run inline, one after another (the engine gives the
same numbers as `fedray sweep`'s Ray tasks); a script's output block is recomputed whole.

A table whose scenario runs under ``runtime.deterministic: strict`` (the portable kernels:
docs/performance.md, "Reproducible on any machine") must come back to the last digit on any
x86-64 machine. Another table does on the machine that ran `make docs-tables`; on another
the kernels torch and numpy pick (ATen's, MKL's and oneDNN's paths for its instruction set
and vendor) round differently, a robust rule's selection can flip, and a `mean ± std` cell
may move: it then counts as reproduced when its mean is within the spread the seeds show,
``|m1 - m2| <= sqrt(s1^2 + s2^2)``, with the same trailing text (pairs, seeds that reached
a target); a cell without a spread must be equal.
"""

from __future__ import annotations

import importlib.util
import math
import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _docs_tables():
    spec = importlib.util.spec_from_file_location("docs_tables", ROOT / "benchmarks" / "docs_tables.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("docs_tables", module)
    spec.loader.exec_module(module)
    return module


docs_tables = _docs_tables()


def markdown_rows(text: str) -> list[dict[str, str]]:
    """The rows of the first Markdown table in ``text``, each a {header: cell} dict."""
    lines = [ln.strip() for ln in text.splitlines() if ln.strip().startswith("|")]
    assert len(lines) >= 2, f"no table in:\n{text}"

    def cells(line: str) -> list[str]:
        return [c.strip() for c in line.strip("|").split("|")]

    head = cells(lines[0])
    return [dict(zip(head, cells(ln))) for ln in lines[2:]]


def block_of(page: str, block_id: str):
    text = (ROOT / page).read_text()
    found = {b.id: b for b in docs_tables.blocks(text)}
    assert block_id in found, f"{page} has no block {block_id}; it has {sorted(found)}"
    b = found[block_id]
    return b, text[b.start:b.end]


SPREAD = re.compile(r"^(-?[0-9.]+(?:e[-+]?[0-9]+)?) ± ([0-9.]+(?:e[-+]?[0-9]+)?)(.*)$")


def reproduced(documented: str, recomputed: str, strict: bool = False) -> bool:
    """Whether a recomputed cell reproduces a documented one (module docstring): equal, or
    (not ``strict``) two ``mean ± std`` cells whose means are within their combined spread."""
    if documented == recomputed or strict:
        return documented == recomputed
    a, b = SPREAD.match(documented), SPREAD.match(recomputed)
    if a is None or b is None or a.group(3) != b.group(3):
        return False
    (m1, s1), (m2, s2) = (map(float, a.group(1, 2)), map(float, b.group(1, 2)))
    return abs(m1 - m2) <= math.hypot(s1, s2)


def test_a_cell_reproduces_exactly_or_within_the_seeds_spread():
    assert reproduced("0.911 ± 0.017", "0.911 ± 0.016")
    assert reproduced("0.557 ± 0.092", "0.657 ± 0.050")  # a Krum selection flipped
    assert reproduced("-0.000194 ± 0.00061 (5 pairs)", "-0.000196 ± 0.00061 (5 pairs)")
    assert not reproduced("0.557 ± 0.012", "0.657 ± 0.010")  # beyond the seeds' spread
    assert not reproduced("41.2 ± 3.1 (2 of 2)", "41.2 ± 3.1 (1 of 2)")
    assert not reproduced("0.911", "0.912") and reproduced("0.911", "0.911")
    assert not reproduced("0.911 ± 0.017", "0.911 ± 0.016", strict=True)


def strict_block(block) -> bool:
    """Whether every point of a table's sweep runs under ``deterministic: strict``."""
    scenario, sets, _ = block.sweep_args()
    return all(p.scenario.runtime.strict
               for p in docs_tables.load(scenario, sets).points)


def test_a_table_says_how_it_reproduces():
    """Each table states its seeds, and either that it is strict or that the last digits
    may differ on another machine (docs_tables.sweep_body)."""
    for page in sorted((ROOT / "docs").glob("*.md")):
        for b in docs_tables.blocks(page.read_text()):
            if b.kind != "table":
                continue
            body = page.read_text()[b.start:b.end]
            note = docs_tables.STRICT_NOTE if strict_block(b) else docs_tables.MACHINE_NOTE
            assert ", seeds " in body and note in body, f"{page.name} {b.id}"


def the_row(rows: list[dict[str, str]], where: dict[str, str]) -> dict[str, str]:
    hits = [r for r in rows if all(r.get(k) == v for k, v in where.items())]
    assert len(hits) == 1, f"{len(hits)} rows with {where} in {rows}"
    return hits[0]


# (page, block, the --set that leaves the cell's point alone, its row, its columns).
# Timing outputs have no cell: docs/async.md's async_throughput and async_throughput_ray,
# docs/models.md's models_zoo and docs/datasets.md's datasets_load are wall-clock seconds of
# the machine that ran them (a rerun gives other seconds); so is docs/performance.md's kernels
# (its numbers are tests/simulator/test_strict.py's subject); `make docs-tables` rewrites
# them, no test compares them.
CELLS = [
    ("docs/datasets.md", "mnist_byzantine",
     "sweep={aggregator.name: [krum], attack: [{name: sign_flip}]}",
     {"aggregator": "krum"}, ["attack=sign_flip"]),
    ("docs/datasets.md", "mnist_byzantine_no_attack",
     "sweep={aggregator.name: [mean], rounds: [30]}",
     {"rounds": "30"}, ["seeds", "test_accuracy (final)"]),
    ("docs/privacy.md", "dp_fedavg_digits",
     "sweep={privacy.noise_multiplier: [1.0]}",
     {"privacy.noise_multiplier": "1.0"}, ["seeds", "test_accuracy (final)", "epsilon (final)"]),
    ("docs/privacy.md", "audit_dp_fedavg",
     "sweep={privacy.noise_multiplier: [1.0]}",
     {"privacy.noise_multiplier": "1.0"},
     ["seeds", "epsilon (final)", "audit_epsilon (final)", "audit_epsilon_lower (final)",
      "test_accuracy (final)"]),
    # clipping alone: DLG (magnitudes) fails, Inverting Gradients (cosine) does not
    ("docs/privacy.md", "attack_reconstruction",
     "sweep={privacy.clip: [0.1], privacy.noise_multiplier: [0.0]}",
     {"privacy.clip": "0.1", "privacy.noise_multiplier": "0.0"},
     ["seeds", "dlg_psnr (final)", "dlg_success (final)", "inverting_gradients_psnr (final)",
      "inverting_gradients_success (final)", "inverting_gradients_success_bound (final)"]),
    ("docs/privacy.md", "attack_membership",
     "sweep={privacy.noise_multiplier: [4.0]}",
     {"privacy.noise_multiplier": "4.0"},
     ["seeds", "epsilon (final)", "loss_threshold_advantage (final)",
      "loss_threshold_advantage_bound (final)", "loss_threshold_auc (final)",
      "test_accuracy (final)"]),
    # LiRA without DP: its 16 runs (2-3 s each), each the target of the 15 others (no
    # epsilon column: a row without DP logs none, and a table refuses a metric no run logged)
    ("docs/privacy.md", "attack_lira",
     "sweep={privacy: [null]}",
     {"privacy": "none"},
     ["seeds x runs", "lira_shadows_auc (final)", "lira_shadows_tpr_at_fpr_0.01 (final)",
      "lira_shadows_advantage (final)", "lira_advantage_bound (final)", "lira_auc (final)",
      "lira_tpr_at_fpr_0.01 (final)"]),
    ("docs/privacy.md", "dp_sgd_digits",
     "sweep={privacy.noise_multiplier: [1.0], aggregator.name: [median]}",
     {"privacy.noise_multiplier": "1.0", "aggregator.name": "median"},
     ["seeds", "test_accuracy (final)", "epsilon (final)"]),
    ("docs/fedro.md", "fedro_sample_size",
     "sweep={clients.per_round: [8]}",
     {"clients.per_round": "8"},
     ["clients.b_hat.value", "seeds", "test_accuracy (final)",
      "relative_aggregation_error (mean)", "byzantine_exceeded (sum)"]),
    ("docs/fedro.md", "fedro_local_steps",
     "sweep={'local.steps, local.lr': [[1, 0.5]]}",
     {"local.steps": "1"},
     ["clients.b_hat.value", "seeds", "test_accuracy (final)",
      "relative_aggregation_error (mean)", "byzantine_exceeded (sum)"]),
    ("docs/fedro.md", "fedro_meta_mu2sgd",
     ("sweep={attack: [{name: label_flip}], 'aggregator.name, preaggregators, meta': "
      "[[mean, [], {name: ctma}]], 'local.optimizer, server.optimizer': "
      "[[{name: momentum, beta: 0.9}, {name: sgd}]]}"),
     {"attack": "label_flip", "aggregator": "mean", "preaggregators": "none",
      "server.optimizer.name": "sgd"}, ["meta=ctma"]),
    ("docs/async.md", "async_asyncfilter",
     "sweep={'aggregator.name, meta': [[median, null]]}",
     {"aggregator": "median", "meta": "none"},
     ["seeds", "test_accuracy (final)", "sim_time (final)", "byzantine_sampled (mean)",
      "staleness_mean (mean)"]),
    # the whole block: the mean's two seeds without Byzantine clients (about 12 s)
    ("docs/async.md", "async_asyncfilter_clean",
     "sweep={aggregator.name: [mean]}",
     {"aggregator": "mean"}, ["seeds", "test_accuracy (final)"]),
    ("docs/async.md", "async_weighted",
     ("sweep={attack: [{name: sign_flip}], asynchrony.weights: [updates], asynchrony.draw: "
      "[id], 'aggregator.name, meta': [[geomed, null]]}"),
     {"asynchrony.draw": "id", "server.optimizer.name": "sgd", "aggregator": "geomed",
      "meta": "none", "asynchrony.weights": "updates"}, ["attack=sign_flip"]),
    ("docs/async.md", "async_vs_sync",
     ("sweep={'server.mode, rounds, asynchrony': [[fedbuff, 80, {concurrency: 20, "
      "buffer_size: 10, staleness: {function: polynomial, a: 0.5}}]]}"),
     {"server.mode": "fedbuff"}, ["seeds", "test_accuracy (final)", "sim_time (final)"]),
    # the gaussian row (the one tests/simulator/test_buffers.py asserts on), both buffer rules
    ("docs/models.md", "bn_buffers_attack",
     "sweep={attack: [{name: gaussian, sigma: 200.0}], server.buffers: [mean, median]}",
     {"attack": "gaussian"}, ["server.buffers=mean", "server.buffers=median"]),
    ("docs/dsgd.md", "dsgd_byzantine",
     "sweep={attack.epsilon: [1.0], dsgd.defense: [clipped_gossip]}",
     {"attack.epsilon": "1.0", "dsgd.defense": "clipped_gossip"},
     ["seeds", "test_accuracy (final)", "min_peer_accuracy (final)",
      "averaged_test_accuracy (final)", "consensus_distance (final)"]),
    # FedAvg dropping 90% stragglers (the cheapest row: its clients do little work)
    ("docs/client-drift.md", "fedprox_stragglers",
     ("sweep={'clients.stragglers.deadline, clients.stragglers.partial, local.optimizer.mu': "
      "[[13.5, false, 0.0]]}"),
     {"clients.stragglers.deadline": "13.5", "clients.stragglers.partial": "false",
      "local.optimizer.mu": "0.0"},
     ["seeds", "train_loss (final)", "test_accuracy (final)", "stragglers (mean)"]),
    # FedProx's own stragglers: FedAvg dropping 90% of them (its one client a round is cheap)
    ("docs/client-drift.md", "fedprox_epochs",
     ("sweep={'clients.stragglers.fraction, clients.stragglers.partial, local.optimizer.mu': "
      "[[0.9, false, 0.0]]}"),
     {"clients.stragglers.fraction": "0.9", "clients.stragglers.partial": "false",
      "local.optimizer.mu": "0.0"},
     ["seeds", "train_loss (final)", "train_loss (mean)", "test_accuracy (final)",
      "stragglers (mean)"]),
    ("docs/client-drift.md", "scaffold_rounds",
     ("sweep={'local.optimizer, server.optimizer': [[{name: sgd}, {name: scaffold, lr: 1.0}]], "
      "'local.steps, speeds.sample_seconds': [[20, 0.005]]}"),
     {"server.optimizer.name": "scaffold", "local.steps": "20"},
     ["seeds", "test_accuracy (simulated s to ≥ 0.85)", "test_accuracy (simulated s to ≥ 0.9)",
      "test_accuracy (final)"]),
    ("docs/communication.md", "comm_error_feedback",
     "sweep={codecs: [[{name: top_k, fraction: 0.01, error_feedback: true}]]}",
     {"codecs": "top_k(fraction=0.01, error_feedback=true)"},
     ["seeds", "test_accuracy (final)", "bytes_up_total (final)"]),
    ("docs/communication.md", "comm_majority_vote",
     ("sweep={'clients.byzantine, clients.b_hat.value': [[8, 8]], "
      "'aggregator, codecs, server.optimizer': [[{name: majority_vote}, "
      "[{name: sign, scale: false}], {name: sgd, lr: 0.03}]]}"),
     {"aggregator": "majority_vote"}, ["clients.byzantine=8"]),
    # NNM + trimmed mean under ALIE on QSGD's rows (one seed, one run)
    ("docs/communication.md", "comm_robust_codecs",
     ("sweep={'attack, clients.byzantine': [[{name: alie}, 4]], 'aggregator, preaggregators': "
      "[[{name: cwtm}, [{name: nnm}]]], codecs: [[{name: qsgd, levels: 4}]]}"),
     {"attack": "alie", "aggregator": "cwtm", "preaggregators": "nnm"},
     ["codecs=qsgd(levels=4)"]),
    # groups of 5 against IPM with 2 Byzantine clients: the spoiled groups' row
    ("docs/communication.md", "comm_secagg",
     ("sweep={attack: [{name: ipm, epsilon: 10.0}], clients.byzantine: [2], "
      "codecs: [[{name: secagg, group_size: 5}]]}"),
     {"attack": "ipm", "codecs": "secagg(group_size=5)"}, ["clients.byzantine=2"]),
    ("docs/communication.md", "comm_secagg_bytes",
     "sweep={codecs: [[{name: secagg, group_size: 10}]]}",
     {"codecs": "secagg(group_size=10)"},
     ["seeds", "test_accuracy (final)", "bytes_up (final)", "bytes_up_total (final)",
      "secagg_groups (final)"]),
    ("docs/communication.md", "comm_bandwidth",
     ("sweep={speeds.bandwidth: [1.0e+5], 'server.mode, rounds, asynchrony': [[fedbuff, 40, "
      "{concurrency: 10, buffer_size: 5, staleness: {function: polynomial, a: 0.5}}]], "
      "codecs: [[{name: qsgd, levels: 4}]]}"),
     {"speeds.bandwidth": "100000.0", "server.mode": "fedbuff", "codecs": "qsgd(levels=4)"},
     ["seeds", "test_accuracy (final)", "sim_time (final)",
      "test_accuracy (simulated s to ≥ 0.7)", "test_accuracy (simulated s to ≥ 0.8)"]),
]


@pytest.mark.parametrize("page, block_id, cell, where, columns", CELLS,
                         ids=[c[1] for c in CELLS])
def test_a_cell_of_each_docs_table_is_what_its_command_gives(page, block_id, cell, where,
                                                             columns, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    block, body = block_of(page, block_id)
    documented = the_row(markdown_rows(body), where)
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    recomputed = the_row(markdown_rows(docs_tables.block_table(
        block, uri, runner="inline", extra_sets=[cell])), where)
    strict = strict_block(block)
    for col in columns:
        assert reproduced(documented[col], recomputed[col], strict), (
            f"{page} {block_id} {where} {col}: documented {documented[col]}, "
            f"recomputed {recomputed[col]}")


# benchmarks/kappa.py (docs/robust-aggregation.md) takes minutes (2 cores), and has no cell
# to run alone: `make docs-tables` regenerates it, no test does
@pytest.mark.parametrize("page, block_id", [("docs/fedro.md", "b_hat"),
                                            ("docs/privacy.md", "privacy_delta"),
                                            ("docs/robust-aggregation.md", "subset_limits"),
                                            ("docs/privacy.md", "dp_compare")])
def test_a_script_output_in_the_docs_is_what_the_script_prints(page, block_id):
    block, body = block_of(page, block_id)
    assert docs_tables.output_body(block) == body


def test_the_markers_parse_and_a_page_is_rewritten_between_them_only(tmp_path):
    page = tmp_path / "page.md"
    page.write_text("prose before\n\n<!-- output one: python -c \"print('| a |')\" -->\nold\n"
                    "<!-- end output -->\n\nprose after\n")
    text, changed = docs_tables.regenerate(page, [], "inline", None, None)
    assert changed == ["one"]
    assert text.startswith("prose before\n\n<!-- output one:") and text.endswith(
        "<!-- end output -->\n\nprose after\n")
    assert "python -c \"print('| a |')\"\n```" in text and "\n| a |\n" in text
    again = tmp_path / "again.md"
    again.write_text(text)
    assert docs_tables.regenerate(again, [], "inline", None, None)[1] == []
    with pytest.raises(SystemExit, match="no block two"):
        docs_tables.regenerate(page, ["two"], "inline", None, None)


def test_the_dsgd_topologies_tables_one_topology_and_its_difference_from_complete(
        tmp_path, monkeypatch):
    """docs/dsgd.md's two tables of one sweep: the exponential graph's row of the first, and
    its paired difference from the complete graph in the second, from the same runs."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    cell = "sweep={topology: [{name: complete}, {name: exponential}]}"
    where = {"topology": "exponential"}
    for block_id, run in (("dsgd_topologies", True), ("dsgd_topologies_paired", False)):
        block, body = block_of("docs/dsgd.md", block_id)
        documented = the_row(markdown_rows(body), where)
        recomputed = the_row(markdown_rows(docs_tables.block_table(
            block, uri, runner="inline", extra_sets=[cell], run=run)), where)
        assert recomputed.keys() == documented.keys()
        bad = {k: (documented[k], recomputed[k]) for k in documented
               if not reproduced(documented[k], recomputed[k])}
        assert not bad, f"docs/dsgd.md {block_id}: {bad}"


def test_the_backdoor_tables_norm_bounding_against_the_distributed_backdoor(tmp_path,
                                                                           monkeypatch):
    """docs/backdoor.md's two tables of one sweep: norm bounding (no noise) against DBA with
    four Byzantine clients (each training its own part of the trigger), its attack success
    rate and its clean accuracy, from the same 3 runs (60 rounds each)."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    cell = ("sweep={clients.byzantine: [4], attack: [{name: backdoor_dba, target: 0, "
            "poison_fraction: 0.5}], aggregator: [{name: norm_bound, bound: 0.35}]}")
    where = {"clients.byzantine": "4", "aggregator": "norm_bound", "aggregator.sigma": "0.0"}
    for block_id, run in (("backdoor_asr", True), ("backdoor_accuracy", False)):
        block, body = block_of("docs/backdoor.md", block_id)
        documented = the_row(markdown_rows(body), where)
        recomputed = the_row(markdown_rows(docs_tables.block_table(
            block, uri, runner="inline", extra_sets=[cell], run=run)), where)
        col = "attack=backdoor_dba"
        assert reproduced(documented[col], recomputed[col]), \
            f"docs/backdoor.md {block_id}: {documented[col]} against {recomputed[col]}"
