# The two commands a newcomer needs: `make demo` and `make test`.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip
NATIVE := rtn hqq kquant

.PHONY: venv demo test lint bench clean

$(VENV)/.installed: pyproject.toml $(foreach p,$(NATIVE),plugins/$(p)/pyproject.toml)
	$(PYTHON) -m venv $(VENV)
	$(PIP) install --quiet --upgrade pip
	$(PIP) install --quiet -e ".[dev]" $(foreach p,$(NATIVE),-e plugins/$(p))
	touch $@

venv: $(VENV)/.installed

demo: venv
	$(VENV)/bin/bitpress demo

test: venv
	$(VENV)/bin/ruff check .
	$(PY) -m pytest -q

lint: venv
	$(VENV)/bin/ruff check .

bench: venv
	$(MAKE) -C bench

clean:
	rm -rf $(VENV) demo-out .pytest_cache
