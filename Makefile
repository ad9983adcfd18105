# envfleet: every target sets up what it needs on a fresh machine (venv, dockerd, base image).
SHELL := /bin/bash
PY := .venv/bin/python
# the extras `make test` needs; the heavy trainer adapters (torch, trl, verl) are `make test-integrations`
EXTRAS := dev,ray,tito,openenv,otel
VENV_STAMP := .venv/.installed-$(shell sha256sum pyproject.toml | cut -c1-12)
BUF_VERSION := 1.75.0
BUF := .tools/node_modules/.bin/buf
TOOLS_PATH := PATH="$(CURDIR)/.tools/node_modules/.bin:$$PATH"

.PHONY: venv buf docker go base-image chromium test test-cluster test-fast test-integrations demo bench bench-scale proto lint image

$(VENV_STAMP): pyproject.toml
	@test -x .venv/bin/python || python3 -m venv .venv
	.venv/bin/pip install -q --disable-pip-version-check --upgrade pip
	.venv/bin/pip install -q --disable-pip-version-check -e '.[$(EXTRAS)]'
	@rm -f .venv/.installed-*
	@touch $@

venv: $(VENV_STAMP)

# buf (protobuf lint) ships as an npm package with the binary inside; without npm, tests/test_proto.py skips it
$(BUF):
	@if command -v npm >/dev/null; then \
		npm install --silent --no-audit --no-fund --prefix .tools @bufbuild/buf@$(BUF_VERSION); \
	else echo "npm not found: buf lint will be skipped"; fi

buf: $(BUF)

docker:
	@scripts/ensure-docker.sh

# The compiled envd in every sandbox image is built on the host with Debian's Go and Go gRPC packages
go:
	@scripts/ensure-go.sh

base-image: venv docker go
	@$(PY) -m orchestrator.cli image build-base

# The trajectory viewer's tests drive a real headless Chromium (Debian's package; no browser download)
chromium:
	@command -v chromium >/dev/null || { \
		if [ "$$(id -u)" = 0 ]; then apt-get install -y -q chromium || { apt-get update -q && apt-get install -y -q chromium; }; \
		else sudo apt-get install -y -q chromium; fi; }

# pytest with these arguments, then the leak check, which runs after a failed run too, where a leak is likeliest; the
# envfleet containers there before the run, and any other of their owners' (a server running beside it), are not the
# run's, and are left alone
checked_pytest = before=$$(mktemp); scripts/check-leaks.sh --list > $$before; rc=0; \
	$(TOOLS_PATH) $(PY) -m pytest -q -p no:cacheprovider $(1) || rc=$$?; scripts/check-leaks.sh $$before || rc=1; \
	rm -f $$before; exit $$rc

# Every test but the Ray cluster's (make test-cluster), which .ci/run runs next
test: venv buf docker base-image chromium
	@$(call checked_pytest,-m "not cluster")

# The tests of a real Ray cluster on this machine (a head and two sandbox-host nodes, a Docker job across them): 1.5-2.5
# minutes, most of it the cluster's start. Ray is in the venv's extras; here a missing Ray fails, never skips.
test-cluster: export ENVFLEET_REQUIRE_CLUSTER := 1
test-cluster: venv docker base-image
	@$(call checked_pytest,-m cluster)

# The tests that need no Docker engine (pytest -m "not docker"): the control plane on the fake backend, envd on the
# host, parsers and validators. Starts no dockerd and builds no image.
test-fast: venv go chromium
	$(PY) -m pytest -q -p no:cacheprovider -m "not docker"

# The trainer adapters' heavy tests (integrations/: TRL's GRPOTrainer on CPU torch, verl's agent loop, SkyRL's env),
# which `make test` skips when their extras are absent. torch is the CPU wheel (a plain `torch` is a CUDA build);
# verl goes in without its dependencies (ray[default], wandb, vllm... and a transformers pin older than ours): the
# agent loop needs only the few below, and imports without a GPU.
VERL_DEPS := hydra-core codetiming dill pylatexenc pillow cachetools fastapi cloudpickle orjson importlib_metadata
test-integrations: venv
	$(PY) -m pip install -q --disable-pip-version-check torch==2.13.0
	$(PY) -m pip install -q --disable-pip-version-check -c <(echo torch==2.13.0) -e '.[$(EXTRAS),trl,skyrl]'
	$(PY) -m pip install -q --disable-pip-version-check --no-deps verl==0.9.1 tensordict==0.10.0 pyvers==0.1.0
	$(PY) -m pip install -q --disable-pip-version-check -c <(echo torch==2.13.0) $(VERL_DEPS)
	ENVFLEET_REQUIRE_INTEGRATIONS=1 TRL_EXPERIMENTAL_SILENCE=1 $(PY) -m pytest -q -p no:cacheprovider \
		tests/integrations tests/environments/test_shaped_reward.py

demo: venv docker base-image
	@$(PY) -m orchestrator.cli demo

bench: venv docker base-image
	$(PY) -m bench.run --out bench/results.json

# Not part of `make test`: holds 1,000 sandboxes at once (minutes, most of the host's memory).
bench-scale: venv docker base-image
	$(PY) -m bench.scale --out bench/results.json

proto: venv
	$(PY) -m grpc_tools.protoc -I. --python_out=. --grpc_python_out=. --pyi_out=. protos/*.proto

lint: venv buf
	@if [ -x $(BUF) ]; then $(BUF) lint; fi
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .
	$(PY) -m mypy envd orchestrator environments integrations bench tests

# The orchestrator's own image, built offline on top of the base image; EXTRA_WHEELS=DIR adds plug-in wheels.
image: venv docker base-image
	@$(PY) -m orchestrator.cli image build-orchestrator $(if $(EXTRA_WHEELS),--extra-wheels $(EXTRA_WHEELS))
