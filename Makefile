# One command sets up and runs the demo, one sets up and runs the tests.
#   make demo    create .venv, install gradwatch (torch pinned, see constraints.txt), run `gradwatch demo`
#   make test    create .venv, install gradwatch with test extras, run the test suite
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip install --quiet --disable-pip-version-check -c constraints.txt
STAMP  := $(VENV)/.installed

.PHONY: install demo test bench clean

$(STAMP): pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(PIP) torch==2.13.0
	$(PIP) -e '.[test]'
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/gradwatch demo $(ARGS)

test: $(STAMP)
	$(PY) -m pytest -q $(ARGS)

bench: $(STAMP)
	$(PY) benchmarks/bench.py $(ARGS)

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache runs
