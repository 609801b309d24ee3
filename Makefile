# fedray: `make quickstart` runs the main job on embedded defaults, `make test` the test suite.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-stamp

.PHONY: install quickstart test lint docs bench bench-models bench-gpu flower-venv bench-flower \
	bench-startup bench-floor bench-population pfl-venv bench-pfl

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[dev,data,cluster,docs]'
	# ByzFL, the reference the aggregator tests agree with; --no-deps: it asks for torchvision,
	# whose PyPI build does not load beside this machine's torch 2.13.0 CPU build.
	$(PY) -m pip install -q --no-deps byzfl==0.0.11
	touch $(STAMP)

install: $(STAMP)

quickstart: $(STAMP)
	$(VENV)/bin/fedray run scenarios/quickstart.yaml

test: lint
	$(PY) -m pytest -q

# ruff (with the C90 complexity rule) and mypy, both clean: part of `make test`, so CI runs them
lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/mypy

# the documentation site in site/: the generated reference pages (fedray/reference.py: the
# schema's keys, every plugin), then MkDocs in strict mode (a warning, a broken link, fails);
# offline (no web fonts, no CDN). tests/test_docs_site.py builds it the same way.
docs: $(STAMP)
	$(PY) -m fedray.reference docs/reference
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict

bench: $(STAMP)
	$(PY) benchmarks/engine_overhead.py
	$(PY) benchmarks/aggregators.py
	$(PY) benchmarks/vectorized.py

# docs/models.md's table: parameters, FLOPs per sample, time per local epoch (fp32, bf16)
bench-models: $(STAMP)
	$(PY) benchmarks/models.py

# the prepared GPU check (ResNet-18, 100 clients / 20 per round, cuda and cpu, fp32 and bf16)
bench-gpu: $(STAMP)
	$(PY) benchmarks/gpu.py --out gpu-results.md

# Flower's simulation engine for benchmarks/vs_flower.py, in its own venv: flwr[simulation]
# pins ray 2.55.1, fedray uses a newer Ray.
flower-venv:
	$(PYTHON) -m venv .venv-flower
	.venv-flower/bin/pip install -q "flwr[simulation]==1.42.0" torch==2.13.0 numpy

bench-flower: $(STAMP)
	test -x .venv-flower/bin/python || $(MAKE) flower-venv
	$(PY) benchmarks/vs_flower.py
	$(PY) benchmarks/vs_flower.py --workload heavy --rounds 60

# start-up: time to the first round against `import torch`, and what each command imports
bench-startup: $(STAMP)
	$(PY) benchmarks/startup.py

# the steady-state round against the same local SGD steps in a bare loop on every core
bench-floor: $(STAMP)
	$(PY) benchmarks/floor.py

# populations of 1 M and 10 M generated clients read a cohort at a time (data.load: cohort):
# seconds a round and peak RSS, against the whole load at 100k (docs/performance.md)
bench-population: $(STAMP)
	$(PY) benchmarks/population.py

# pfl-research 0.6 for benchmarks/vs_pfl.py, in its own venv (pfl pins its own dependencies;
# dp-accounting < 0.6 is the last that installs beside it, torch pinned to the CPU build)
pfl-venv:
	$(PYTHON) -m venv .venv-pfl
	.venv-pfl/bin/pip install -q "pfl[pytorch]==0.6.0" torch==2.13.0 "dp-accounting<0.6" numpy

bench-pfl: $(STAMP)
	test -x .venv-pfl/bin/python || $(MAKE) pfl-venv
	$(PY) benchmarks/vs_pfl.py

# every table of numbers in docs/ regenerated from its scenario file (a sweep into a fresh
# sqlite:/// store, then `fedray table`) or from its benchmark script, rewritten between its
# <!-- table|output ID: ... --> markers with the commands beside it (benchmarks/docs_tables.py;
# tests/test_docs_tables.py recomputes a cell of each). Timing tables are measurements of
# this machine: docs/performance.md's are printed by `make bench*`; docs/async.md's
# (async_throughput*), docs/models.md's (models_zoo, as `make bench-models`) and
# docs/datasets.md's (datasets_load: load seconds) are rewritten here too, and no test
# recomputes them.
.PHONY: docs-tables
docs-tables: $(STAMP)
	$(PY) benchmarks/docs_tables.py docs/datasets.md mnist_byzantine
	$(PY) benchmarks/docs_tables.py docs/datasets.md mnist_byzantine_no_attack
	$(PY) benchmarks/docs_tables.py docs/datasets.md datasets_load
	$(PY) benchmarks/docs_tables.py docs/privacy.md dp_sgd_digits
	$(PY) benchmarks/docs_tables.py docs/privacy.md dp_fedavg_digits
	$(PY) benchmarks/docs_tables.py docs/privacy.md privacy_delta
	$(PY) benchmarks/docs_tables.py docs/privacy.md dp_compare
	$(PY) benchmarks/docs_tables.py docs/privacy.md audit_dp_fedavg
	$(PY) benchmarks/docs_tables.py docs/privacy.md attack_reconstruction
	$(PY) benchmarks/docs_tables.py docs/privacy.md attack_membership
	$(PY) benchmarks/docs_tables.py docs/privacy.md attack_lira
	$(PY) benchmarks/docs_tables.py docs/fedro.md b_hat
	$(PY) benchmarks/docs_tables.py docs/fedro.md fedro_sample_size
	$(PY) benchmarks/docs_tables.py docs/fedro.md fedro_local_steps
	$(PY) benchmarks/docs_tables.py docs/fedro.md fedro_meta_mu2sgd
	$(PY) benchmarks/docs_tables.py docs/dsgd.md dsgd_topologies dsgd_topologies_paired
	$(PY) benchmarks/docs_tables.py docs/dsgd.md dsgd_byzantine
	$(PY) benchmarks/docs_tables.py docs/robust-aggregation.md kappa
	$(PY) benchmarks/docs_tables.py docs/robust-aggregation.md subset_limits
	$(PY) benchmarks/docs_tables.py docs/client-drift.md fedprox_stragglers
	$(PY) benchmarks/docs_tables.py docs/client-drift.md fedprox_epochs
	$(PY) benchmarks/docs_tables.py docs/client-drift.md scaffold_rounds
	$(PY) benchmarks/docs_tables.py docs/client-drift.md drift_overhead
	$(PY) benchmarks/docs_tables.py docs/backdoor.md backdoor_asr backdoor_accuracy
	$(PY) benchmarks/docs_tables.py docs/async.md async_asyncfilter
	$(PY) benchmarks/docs_tables.py docs/async.md async_asyncfilter_clean
	$(PY) benchmarks/docs_tables.py docs/async.md async_weighted
	$(PY) benchmarks/docs_tables.py docs/async.md async_vs_sync
	$(PY) benchmarks/docs_tables.py docs/async.md async_throughput
	$(PY) benchmarks/docs_tables.py docs/async.md async_throughput_ray
	$(PY) benchmarks/docs_tables.py docs/models.md bn_buffers_attack
	$(PY) benchmarks/docs_tables.py docs/models.md models_zoo
	$(PY) benchmarks/docs_tables.py docs/performance.md kernels
	$(PY) benchmarks/docs_tables.py docs/performance.md session sweep_cost
	$(PY) benchmarks/docs_tables.py docs/performance.md object_store_bytes codec_cost
	$(PY) benchmarks/docs_tables.py docs/communication.md comm_error_feedback
	$(PY) benchmarks/docs_tables.py docs/communication.md comm_majority_vote
	$(PY) benchmarks/docs_tables.py docs/communication.md comm_robust_codecs
	$(PY) benchmarks/docs_tables.py docs/communication.md comm_secagg
	$(PY) benchmarks/docs_tables.py docs/communication.md comm_secagg_bytes
	$(PY) benchmarks/docs_tables.py docs/communication.md comm_bandwidth
