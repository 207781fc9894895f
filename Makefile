# The two commands of the README: `make demo` and `make test`.
# Both create .venv/ on first use and install what they need; re-running skips the install.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
TORCH_PIN := torch==2.13.0
STAMP := $(VENV)/.installed

.PHONY: demo test test-avx2 install bench clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	# The CPU build of torch lies on this machine's disk; an unpinned torch would pull a CUDA build.
	$(BIN)/python -m pip install --quiet $(TORCH_PIN)
	$(BIN)/python -m pip install --quiet -e ".[test,cli]"
	# Compile the fused CPU kernels now (once, cached) rather than at first use; without a compiler: one warning.
	-$(BIN)/python -m sublayer.kernels
	touch $(STAMP)

install: $(STAMP)

test: $(STAMP)
	$(BIN)/python -m pytest

# The kernels and engines as an AVX2 + FMA CPU runs them (built for x86-64-v3), on any x86 CPU.
test-avx2: $(STAMP)
	SUBLAYER_ISA=avx2 $(BIN)/python -m pytest tests/kernels tests/runtime tests/models

demo: $(STAMP)
	$(BIN)/sublayer demo

bench: $(STAMP)
	$(BIN)/sublayer bench

clean:
	rm -rf $(VENV) build dist .pytest_cache
