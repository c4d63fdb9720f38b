# One command sets up and runs the demo, one sets up and runs the tests.
#   make demo    create .venv, install gradwatch (torch pinned, see constraints.txt), run `gradwatch demo`
#   make test    create .venv, install gradwatch with test extras, run the gates (ruff, mypy, lint-imports: the
#                layers in pyproject.toml), install Chromium for the browser test where missing (apt-get, as root;
#                elsewhere it says why and the test is skipped), then the test suite (2 workers; it builds the docs
#                with --strict)
#   make docs    build the documentation site (mkdocs.yml, docs/) into site/, warnings as errors
PYTHON ?= python3
# mkdocs-material prints a banner about MkDocs 2 at every build; the build itself is what we read.
export NO_MKDOCS_2_WARNING := 1
# Bytecode is written (__pycache__, ignored by git) even where the environment says not to: the suite starts
# about 80 Python processes, and each would otherwise compile gradwatch's 90 modules again (0.6-0.8 s each).
export PYTHONDONTWRITEBYTECODE :=
VENV   ?= .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip install --quiet --disable-pip-version-check -c constraints.txt
STAMP  := $(VENV)/.installed
# pytest-xdist workers (WORKERS=0 runs the suite in one process). Two on CI's two cores: the suite is bound by
# CPU (the workers and the rank processes they start kept both cores busy), and a third worker only made every
# process slower (more processes than cores: 12% more CPU time for the same tests). Measured on 2 cores (pytest
# time, 2026-12-05, one checkout, back to back): 3 workers 6:15 (737 s of CPU), 2 workers 5:42 (651 s). Each test
# file runs whole on one worker (--dist loadfile), so the costly fixtures of a module are built once.
# ARGS="-m 'not slow'" skips the slow ones.
WORKERS ?= 2

.PHONY: install demo test bench docs clean

$(STAMP): pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(PIP) torch==2.13.0
	$(PIP) -e '.[test]'
	touch $(STAMP)

# DeepSpeed compiles its CPU communication op at first use (about 45 s here): once, before the tests, so the
# 2-rank DeepSpeed test's time limit counts its run only (tests/parallel/test_zero.py builds it too when missing).
DS_OPS := $(VENV)/.deepspeed_ops

$(DS_OPS): $(STAMP)
	DS_ACCELERATOR=cpu $(PY) -c "from deepspeed.comm.torch import build_shm_op; build_shm_op()"
	touch $(DS_OPS)

install: $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/gradwatch demo $(ARGS)

test: $(STAMP) $(DS_OPS)
	$(VENV)/bin/ruff check .
	$(PY) -m mypy gradwatch
	$(VENV)/bin/lint-imports
	$(PY) tests/browser.py install
	$(PY) -m pytest -q -n $(WORKERS) --dist loadfile $(ARGS)

bench: $(STAMP)
	$(PY) benchmarks/bench.py $(ARGS)

docs: $(STAMP)
	$(VENV)/bin/mkdocs build --strict --site-dir site

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache runs site
