# The two commands of the README: `make demo` and `make test`. Both install what is
# missing first (scripts/setup.sh is idempotent).
.PHONY: setup demo demo-pool test lint unit integration bench clean

export RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER ?= 0
VENV := .venv/bin

setup:
	@scripts/setup.sh

demo: setup
	$(VENV)/python scripts/demo_vllm.py

demo-pool: setup
	$(VENV)/python scripts/demo_pool.py

lint: setup
	$(VENV)/ruff check .
	$(VENV)/ruff format --check .
	$(VENV)/mypy

test: lint
	$(VENV)/pytest -q

unit: setup
	$(VENV)/pytest -q tests/unit

integration: setup
	$(VENV)/pytest -q tests/integration

bench: setup
	$(VENV)/python scripts/bench_store.py --json bench-results/bench_store.json

clean:
	rm -rf .venv build *.egg-info .pytest_cache .mypy_cache .ruff_cache
