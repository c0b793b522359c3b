# Quick start: `make report` (strategy comparison on the embedded store) and `make test` (everything).
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: venv servers lint typecheck pytest test report clean

venv: $(STAMP)

$(STAMP): pyproject.toml
	python3 -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[dev,valkey,glide]'
	touch $(STAMP)

servers: $(STAMP)
	$(PY) -m sim.servers provision

lint: $(STAMP)
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .

typecheck: $(STAMP)
	$(PY) -m mypy anarchon sim

pytest: $(STAMP)
	$(PY) -m pytest -n 2

test: servers lint typecheck pytest

report: $(STAMP)
	$(PY) -m sim report --out reports/latest

clean:
	rm -rf $(VENV) .mypy_cache .ruff_cache .pytest_cache
