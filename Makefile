# Every target that runs code depends on `setup`, so a fresh clone needs only `make demo` or `make test`.

PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
# The torch the tests run on, the CPU build, pinned and installed first. The package's own floor
# (`torch>=2.7` in pyproject.toml) is what the code needs; installing this first meets it, where
# a bare `torch` can resolve to a multi-gigabyte CUDA build on a host with no GPU.
TORCH := torch==2.13.0

.PHONY: setup test test-quick demo lint clean

setup: $(STAMP)

# PYTHONWARNINGS=ignore on the last step: setuptools prints a banner on every editable install
# (about folders named like the package) that says nothing about this project.

$(STAMP): pyproject.toml
	@echo "setup 1/4: a virtual environment in $(VENV) with a current pip"
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	@echo "setup 2/4: $(TORCH), the CPU build (pip shows its progress)"
	$(BIN)/python -m pip install --progress-bar on '$(TORCH)'
	@echo "setup 3/4: kvctl and its development tools"
	PYTHONWARNINGS=ignore $(BIN)/python -m pip install --progress-bar on -e '.[dev]'
	@echo "setup 4/4: the CPU kernels, compiled once for this machine (about 30 s; skipped where they cannot run)"
	$(BIN)/python -m kvctl.agent.kernels
	touch $(STAMP)
	@echo "setup done: $(VENV)"

# The whole suite: what CI runs. `test-quick` leaves out the tests marked slow (real agents under
# long loads, real Prometheus and Alertmanager, the demo): the loop to run while editing.
test: setup
	$(BIN)/pytest -q

test-quick: setup
	$(BIN)/pytest -q -m "not slow"

demo: setup
	scripts/demo.sh

# ruff: style, imports, layering rules and a complexity ceiling (pyproject.toml); mypy: the
# package's types, strictly on the torch-free pool core.
lint: setup
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy

clean:
	rm -rf $(VENV) build dist *.egg-info .pytest_cache .ruff_cache .hypothesis
	find . -name __pycache__ -type d -prune -exec rm -rf {} +
