# The two commands that matter (README): `make demo` runs the main job, `make test` runs the checks.
# Both create .venv and install the project on first use, so they work on a fresh clone.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed

.PHONY: demo console test test-fast test-cluster lint typecheck unit rest install clean

# Unit tests (no services, seconds) run before the rest (RabbitMQ + Redis, minutes), so a unit failure
# shows at once. Together the two runs cover every test under tests/ (pyproject testpaths) except those
# marked long, which `make test-cluster` runs.
UNIT_TESTS := tests/unit tests/golden
NOT_UNIT   := $(foreach d,$(UNIT_TESTS),--ignore=$(d))
NOT_LONG   := -m 'not long'

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -e '.[dev]'
	touch $(STAMP)

install: $(STAMP)

# The console's browser tests drive Debian's chromium with Playwright (a dev dependency): installed here
# when missing (as root, from Debian's packages), since `playwright install` cannot download browsers.
CHROMIUM := /usr/bin/chromium
$(CHROMIUM):
	apt-get install -y --no-install-recommends chromium || \
	  (apt-get update && apt-get install -y --no-install-recommends chromium)

demo: $(STAMP)
	$(BIN)/python scripts/demo.py

console: $(STAMP)  # the web console with runs to look at (scripts/console.py); Ctrl-C stops it
	$(BIN)/python scripts/console.py

lint: $(STAMP)
	$(BIN)/ruff check orchestrator workers tests
	$(BIN)/ruff format --check orchestrator workers

typecheck: $(STAMP)
	$(BIN)/mypy

unit: $(STAMP)
	$(BIN)/python -m pytest $(UNIT_TESTS)

rest: $(STAMP) $(CHROMIUM)  # integration, CLI, browser and fault-injection tests
	$(BIN)/python -m pytest tests $(NOT_UNIT) $(NOT_LONG)

# Everything, unit tests first (what .ci/run runs): about 9-10 minutes on 2 cores.
test: lint typecheck $(CHROMIUM)
	$(BIN)/python -m pytest $(UNIT_TESTS)
	$(BIN)/python -m pytest tests $(NOT_UNIT) $(NOT_LONG)

# The cluster suites too long for CI (Redis Cluster failover and slot migration, RabbitMQ cluster node
# loss under load): run before a release and quoted in the change's notes.
test-cluster: $(STAMP)
	$(BIN)/python -m pytest tests $(NOT_UNIT) -m long

# The quick loop: everything but the fault suite (tests/faults) and the tests marked slow.
test-fast: lint typecheck $(CHROMIUM)
	$(BIN)/python -m pytest $(UNIT_TESTS) -x -q
	$(BIN)/python -m pytest tests $(NOT_UNIT) --ignore=tests/faults -m 'not slow and not long'

clean:
	rm -rf $(VENV) .mypy_cache .pytest_cache .ruff_cache .hypothesis
