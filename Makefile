# Two commands for a fresh machine (see README):
#   make quickstart   set up, run the quickstart headless on whatever device is here, write report/
#   make test         set up, run the unit tests, every notebook (nbval, smoke mode) and the browser tests
#   make test-fast    the edit-test loop: unit tests and doctests only (no slow, notebook or browser tests;
#                     without nbval, whose import of nbformat costs each pytest process ~2 s)
PYTHON ?= python3
export PYTHONUNBUFFERED := 1

.PHONY: setup quickstart test test-fast

# torch first: an existing torch (Colab's CUDA build) is kept; otherwise the CPU-friendly 2.13.0.
# pip runs again only when pyproject.toml is newer than the last setup (.setup-done) or this Python does not
# find torch, or finds a colabkit other than this checkout's (an editable install of another clone).
setup:
	@if [ .setup-done -nt pyproject.toml ] && $(PYTHON) -c "import importlib.util as u, os, sys; \
	    c = u.find_spec('colabkit'); sys.exit(not (u.find_spec('torch') and c and \
	    os.path.dirname(c.origin) == os.path.abspath('colabkit')))" 2>/dev/null; then \
	    echo "setup: up to date (delete .setup-done to reinstall)"; \
	else \
	    ($(PYTHON) -c "import torch" 2>/dev/null || $(PYTHON) -m pip install -q torch==2.13.0) && \
	    $(PYTHON) -m pip install -q -e ".[dev]" && touch .setup-done; \
	fi

quickstart: setup
	$(PYTHON) -m colabkit.quickstart --out report

# PYTHONDONTWRITEBYTECODE emptied: bytecode and pytest's rewritten test modules are cached as on any default
# Python (some sandboxes switch the cache off; then every worker and every CLI subprocess compiles again).
PYTEST = COLABKIT_SMOKE=1 OMP_NUM_THREADS=1 PYTHONDONTWRITEBYTECODE= $(PYTHON) -m pytest -q -rs -n 2 --dist loadfile --doctest-modules

test: setup
	$(PYTEST) --nbval-lax --nbval-current-env --durations=20 colabkit tests notebooks

test-fast: setup
	$(PYTEST) -p no:nbval -m "not slow and not browser" colabkit tests
