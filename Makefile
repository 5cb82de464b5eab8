# The two commands of the README: `make demo` and `make test`. Both install what is
# missing first (scripts/setup.sh is idempotent).
.PHONY: setup demo demo-pool test lint unit integration bench smoke clean

export RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER ?= 0
VENV := .venv/bin

setup:
	@scripts/setup.sh

# ARGS: more arguments for the script, e.g. `make demo ARGS=--smoke` (the same run,
# smaller) or `make bench ARGS="--reps 7" BENCH_JSON=/tmp/bench_store.json`.
ARGS ?=
BENCH_JSON ?= bench-results/bench_store.json

demo: setup
	$(VENV)/python scripts/demo_vllm.py $(ARGS)

demo-pool: setup
	$(VENV)/python scripts/demo_pool.py $(ARGS)

lint: setup
	$(VENV)/ruff check .
	$(VENV)/ruff format --check .
	$(VENV)/mypy

# Two xdist workers (a module per unit of work; docs/tests.md, "Two workers"); the 30
# slowest tests are printed: where the suite's time goes. Then how old each committed
# benchmark result is (commits since it that touched what it measures), for CI's log
# only: it never fails the target.
TEST_WORKERS ?= 2
test: lint
	$(VENV)/pytest -q -n $(TEST_WORKERS) --durations=30
	-$(VENV)/python scripts/report.py --stale

unit: setup
	$(VENV)/pytest -q tests/unit

integration: setup
	$(VENV)/pytest -q tests/integration

bench: setup
	$(VENV)/python scripts/bench_store.py --json $(BENCH_JSON) $(ARGS)

# Every script's smoke run (--smoke: its full run with small arguments), as the suite
# runs them: tests/*/test_scripts.py, tests/unit/test_device_check.py and
# tests/unit/test_docs_rendered.py (report.py).
smoke: setup
	$(VENV)/pytest -q tests/unit/test_scripts.py tests/unit/test_device_check.py \
		tests/unit/test_docs_rendered.py tests/integration/test_scripts.py \
		tests/e2e/test_scripts.py

clean:
	rm -rf .venv build *.egg-info .pytest_cache .mypy_cache .ruff_cache
