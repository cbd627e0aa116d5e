# flashledger: the two commands of the README are `make run` and `make test`.
PY      ?= python3
VENV    := .venv
BIN     := $(VENV)/bin
STAMP   := $(VENV)/.installed
HOST    ?= 127.0.0.1
PORT    ?= 8000

.PHONY: native run test test-all test-backend test-backends test-avx2 lint format typecheck bench verify clean browser-deps

# the numerical tests: what a matmul back end or the PyTorch step can change
NUMERIC_TESTS := tests/test_blocked.py tests/test_native.py tests/test_features.py \
	tests/test_fast_path.py tests/test_properties.py tests/test_verify.py \
	tests/test_verify_matrix.py tests/test_docs.py tests/test_lane.py \
	tests/test_kvcache.py tests/test_flex.py
# the native step's matmul back ends here, and one other than its choice for float32 (other
# than its forward's too, where there is one)
GEMMS = $(shell $(BIN)/python -c "from flashledger import _native as n; k = n.kernels(); print(' '.join(k.gemm_names()) if k else '')")
OTHER_GEMM = $(shell $(BIN)/python -c "import torch; from flashledger import _native as n; k = n.kernels(); c = [k.gemm(torch.float32), k.gemm(torch.float32, forward=True)] if k else []; o = [g for g in k.gemm_names() if g != c[0]] if k else []; print(next((g for g in o if g not in c), o[0] if o else ''))")

$(STAMP): pyproject.toml constraints.txt
	@test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -c constraints.txt -e '.[dev]'
	@touch $(STAMP)

# the native step built and its choices measured once, up front (about ten seconds the
# first time on a machine, then read back), not inside the first request or test that needs it
native: $(STAMP)
	@$(BIN)/python -c "import flashledger; print(flashledger.native_status())"

run: $(STAMP) native
	$(BIN)/flashledger explore --host $(HOST) --port $(PORT)

browser-deps:
	@command -v chromium >/dev/null 2>&1 || test -x /usr/bin/chromium || \
	  { echo "installing Debian's chromium for the browser tests"; \
	    (apt-get update -qq && apt-get install -y -qq chromium fonts-wqy-microhei) >/dev/null || \
	    { echo "could not install chromium: run 'apt-get install chromium' as root"; exit 1; }; }

test: $(STAMP) browser-deps native
	$(BIN)/python -m pytest -n 2 -m "not slow"

test-all: $(STAMP) browser-deps
	$(BIN)/python -m pytest -n 2 -m "slow or not slow"

# the numerical tests again on one matmul back end: make test-backend GEMM=blas (default: one
# the native step did not choose here)
test-backend: $(STAMP)
	@g="$(or $(GEMM),$(OTHER_GEMM))"; if [ -z "$$g" ]; then echo "no other matmul back end here"; \
	else echo "== FLASHLEDGER_GEMM=$$g"; \
	  FLASHLEDGER_GEMM=$$g $(BIN)/python -m pytest -n 2 -m "not slow" $(NUMERIC_TESTS); fi

# the numerical tests on the native step's AVX2 form (an AMD EPYC's without AVX-512) where
# this CPU has AVX-512 (where it has not, make test ran that form already)
test-avx2: $(STAMP)
	@if grep -qw avx512f /proc/cpuinfo && grep -qw avx2 /proc/cpuinfo; then \
	  echo "== FLASHLEDGER_NATIVE_ARCH=x86-64-v3"; \
	  FLASHLEDGER_NATIVE_ARCH=x86-64-v3 $(BIN)/python -m pytest -q -n 2 -m "not slow" $(NUMERIC_TESTS); \
	else echo "no AVX-512 here: make test ran the native step's AVX2 form"; fi

# the numerical tests on every back end, on the PyTorch step, with MKL held to AVX2, and on
# the native step's plain AVX-512 (no BF16, FP16 or AMX instructions), AVX2 and SSE forms
test-backends: $(STAMP) test-avx2
	@for g in $(GEMMS); do echo "== FLASHLEDGER_GEMM=$$g"; \
	  FLASHLEDGER_GEMM=$$g $(BIN)/python -m pytest -q -n 2 -m "not slow" $(NUMERIC_TESTS) || exit 1; done
	@echo "== FLASHLEDGER_NATIVE=0"
	FLASHLEDGER_NATIVE=0 $(BIN)/python -m pytest -q -n 2 -m "not slow" $(NUMERIC_TESTS)
	@echo "== MKL_ENABLE_INSTRUCTIONS=AVX2"
	MKL_ENABLE_INSTRUCTIONS=AVX2 $(BIN)/python -m pytest -q -n 2 -m "not slow" $(NUMERIC_TESTS)
	@if grep -qw avx512bw /proc/cpuinfo; then \
	  echo "== FLASHLEDGER_NATIVE_ARCH=x86-64-v4 (AVX-512 F/BW/CD/DQ/VL only)"; \
	  FLASHLEDGER_NATIVE_ARCH=x86-64-v4 $(BIN)/python -m pytest -q -n 2 -m "not slow" $(NUMERIC_TESTS); \
	else echo "no AVX-512 here: no plain AVX-512 form to test"; fi
	@echo "== FLASHLEDGER_NATIVE_ARCH=x86-64 (SSE2 only: no FMA, no own kernel)"
	FLASHLEDGER_NATIVE_ARCH=x86-64 $(BIN)/python -m pytest -q -n 2 -m "not slow" $(NUMERIC_TESTS)

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
	$(BIN)/flashledger bench --decode --out benchmarks/results
	$(BIN)/flashledger bench --contention --out benchmarks/results

verify: $(STAMP)
	$(BIN)/flashledger verify --quick

clean:
	rm -rf $(VENV) build dist *.egg-info src/*.egg-info .pytest_cache .ruff_cache .mypy_cache
