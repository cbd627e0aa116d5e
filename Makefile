# flashledger: the two commands of the README are `make run` and `make test`.
PY      ?= python3
VENV    := .venv
BIN     := $(VENV)/bin
STAMP   := $(VENV)/.installed
HOST    ?= 127.0.0.1
PORT    ?= 8000

.PHONY: run test test-all lint format typecheck bench verify clean browser-deps

$(STAMP): pyproject.toml constraints.txt
	@test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -c constraints.txt -e '.[dev]'
	@touch $(STAMP)

run: $(STAMP)
	$(BIN)/flashledger explore --host $(HOST) --port $(PORT)

browser-deps:
	@command -v chromium >/dev/null 2>&1 || test -x /usr/bin/chromium || \
	  { echo "installing Debian's chromium for the browser tests"; \
	    (apt-get update -qq && apt-get install -y -qq chromium fonts-wqy-microhei) >/dev/null || \
	    { echo "could not install chromium: run 'apt-get install chromium' as root"; exit 1; }; }

test: $(STAMP) browser-deps
	$(BIN)/python -m pytest -n 2 -m "not slow"

test-all: $(STAMP) browser-deps
	$(BIN)/python -m pytest -n 2 -m "slow or not slow"

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

format: $(STAMP)
	$(BIN)/ruff format .
	$(BIN)/ruff check --fix .

typecheck: $(STAMP)
	$(BIN)/mypy src/flashledger

bench: $(STAMP)
	$(BIN)/flashledger bench --out benchmarks/results

verify: $(STAMP)
	$(BIN)/flashledger verify --quick

clean:
	rm -rf $(VENV) build dist *.egg-info src/*.egg-info .pytest_cache .ruff_cache .mypy_cache
