# The two commands the README starts with. Each bootstraps .venv when missing or out of date
# (torch CPU first, through constraints/cpu.txt; then the package with its test extra), then runs.
VENV    ?= .venv
PY      := $(VENV)/bin/python
STAMP   := $(VENV)/.asyncrl-installed
PIP     := $(PY) -m pip install --disable-pip-version-check -c constraints/cpu.txt
PYTEST_ARGS ?=

.PHONY: demo test install clean-venv

install: $(STAMP)

$(STAMP): pyproject.toml constraints/cpu.txt Makefile
	test -x $(PY) || python3 -m venv $(VENV)
	$(PIP) --upgrade pip
	$(PIP) torch==2.13.0
	$(PIP) --only-binary hivemind -e '.[test]'
	touch $(STAMP)

demo: $(STAMP)
	$(PY) -m asyncrl.cli demo --clients 2 --json-out runs/demo.json

test: $(STAMP)
	$(PY) -m pytest $(PYTEST_ARGS)

clean-venv:
	rm -rf $(VENV)
