# The two commands a newcomer needs:
#   make demo   an AFD deployment of a locally made tiny model, answering requests
#   make test   the test suite (what CI runs)
.PHONY: setup demo test test-fast lint bench-connector

# pytest-xdist workers of `make test`, one test file at a time each; 0: one
# process. Two on a 2-core, 24 GiB host gained about 10 % (the end-to-end
# tests keep both cores busy) and once left a server start 1 GiB short of
# memory: use them on bigger hosts (docs/testing.md)
TEST_WORKERS ?= 0

setup:
	@bash tools/setup.sh

demo: setup
	.venv/bin/vllm-afd demo

test: setup
	.venv/bin/ruff check vllm_afd tests tools
	.venv/bin/ruff format --check vllm_afd tests tools
	.venv/bin/mypy vllm_afd
	.venv/bin/python -m pytest -q -p no:cacheprovider --durations=60 -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder

# A few minutes: lint, types, unit and connector tests (no vLLM servers).
test-fast: setup
	.venv/bin/ruff check vllm_afd tests tools
	.venv/bin/ruff format --check vllm_afd tests tools
	.venv/bin/mypy vllm_afd
	.venv/bin/python -m pytest -q -p no:cacheprovider tests/unit tests/connector

lint: setup
	.venv/bin/ruff check vllm_afd tests tools
	.venv/bin/ruff format --check vllm_afd tests tools
	.venv/bin/mypy vllm_afd

bench-connector: setup
	.venv/bin/python tools/bench_connector.py
