# Quick start: `make report` (strategy comparison on the embedded store) and `make test` (everything).
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: venv servers lint typecheck pytest pythons test report clean

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

# Four workers on two cores: most tests wait on real time (live scenarios, leases, outages), about 740 CPU
# seconds in 760 s of wall time. Work stealing keeps a worker from holding a long run of slow tests to the end.
pytest: $(STAMP)
	$(PY) -m pytest -n 4 --dist worksteal

# The library on the other supported Pythons (3.11-3.13) the machine has (tools/other-pythons says which it lacks).
pythons: servers
	tools/other-pythons

test: servers lint typecheck pytest pythons

report: $(STAMP)
	$(PY) -m sim report --out reports/latest

clean:
	rm -rf $(VENV) .venv-3.* .mypy_cache .ruff_cache .pytest_cache
