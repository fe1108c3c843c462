# Two commands do everything on a fresh machine:
#   make run    venv + install, compile the bundled tiny MoE (examples/models/tiny-moe), generate text
#   make test   venv + install with the test extras (torch CPU, transformers), run the tests
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
DEMO   ?= demo
QUANT  ?= int8
MODEL  ?= examples/models/tiny-moe
PROMPT ?= The Python interpreter

.PHONY: run test install clean

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q -e .
	touch $@

$(VENV)/.test-installed: $(VENV)/.installed
	$(BIN)/pip install -q -e '.[test]'
	touch $@

install: $(VENV)/.installed

run: $(VENV)/.installed
	$(BIN)/stratac compile $(MODEL) -o $(DEMO)/plan --quant $(QUANT)
	$(BIN)/strata-run $(DEMO)/plan/plan.bin --prompt "$(PROMPT)" --max-new-tokens 32

test: $(VENV)/.test-installed
	$(BIN)/python -m pytest -q

clean:
	rm -rf $(DEMO) $(VENV) .pytest_cache
