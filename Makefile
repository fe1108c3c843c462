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

# An editable install whose checkout is a path entry (compat): setuptools' default editable finder
# runs after Python's own, so a folder named `strata` in the current directory (the clone's parent,
# a plan folder) would shadow `import strata` (pypa/setuptools#3557); strata_compiler maps passes/,
# backends/ and runtime/ itself when run from a checkout.
EDITABLE := --config-settings editable_mode=compat

$(VENV)/.installed: pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q -e . $(EDITABLE)
	touch $@

$(VENV)/.test-installed: $(VENV)/.installed
	$(BIN)/pip install -q -e '.[test]' $(EDITABLE)
	touch $@

install: $(VENV)/.installed

run: $(VENV)/.installed
	$(BIN)/stratac compile $(MODEL) -o $(DEMO)/plan --quant $(QUANT)
	$(BIN)/strata-run $(DEMO)/plan/plan.bin --prompt "$(PROMPT)" --max-new-tokens 32
	@echo "the commands are in $(BIN): source $(BIN)/activate to put them on your PATH"

test: $(VENV)/.test-installed
	$(BIN)/python -m pytest -q

clean:
	rm -rf $(DEMO) $(VENV) .pytest_cache
