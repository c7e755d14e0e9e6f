# The two commands a fresh machine needs (each does its own set-up):
#   make demo   — the main job: a tiny MoE trains on CPU, its events flow into a fresh ledger, history printed
#   make test   — the whole test suite (starts its own Kafka broker from Maven Central's jars; real
#                 GitHub webhook payloads from the npm registry, checked against a pinned sha512)
PYTHON ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-$(shell cat pyproject.toml | sha1sum | cut -c1-12)

.PHONY: setup demo test kafka-jars fixtures browser nginx go-tools lint bench clean

# Every user's install at once (issue 41): the extras ledger (analysts), operator, trainer and the test tools.
$(STAMP): pyproject.toml
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e '.[ledger,operator,trainer,test]'
	@rm -f $(VENV)/.installed-*
	@touch $(STAMP)

setup: $(STAMP)

kafka-jars:
	scripts/kafka.sh fetch

fixtures:
	scripts/fixtures.sh fetch

# Chromium + chromedriver (Debian packages) for tests/web; says why and goes on when it cannot install.
browser:
	scripts/browser.sh install

# nginx-light (Debian) for the tests of DuckDB reading a published copy by URL (Range requests);
# says why and goes on when it cannot install (those tests then skip with the reason).
nginx:
	scripts/http.sh install

# litewitness (torchwood v0.6.1), the torchwood verifier of tests/merkle/go_verify and the S3 server
# versitygw v1.8.0 (tests/merkle/test_remote_s3.py), built from the Go module proxy into .go/ before the
# tests run (minutes the first time, cached after); says why and goes on when there is no Go toolchain
# (those tests then skip with the reason).
go-tools:
	@if command -v go >/dev/null; then scripts/witness.sh build && scripts/witness.sh goverify && scripts/s3.sh build; \
	else echo "go-tools: no go toolchain here: the witness, Go verifier and S3 tests will skip"; fi

demo: setup
	$(BIN)/ledger demo

# RUNLEDGER_REQUIRE_FIXTURES: a test needing the downloaded fixtures fails instead of skipping.
test: setup kafka-jars fixtures browser nginx go-tools
	$(BIN)/ruff check .
	$(BIN)/mypy
	RUNLEDGER_REQUIRE_FIXTURES=1 $(BIN)/pytest -q -p no:cacheprovider

lint: setup
	$(BIN)/ruff check .
	$(BIN)/mypy
	$(BIN)/ruff format --check .

bench: setup kafka-jars
	$(BIN)/python -m bench.bench_ledger
	$(BIN)/python -m bench.bench_merkle --leaves 1000000

clean:
	rm -rf .runledger .kafka/data* .pytest_cache
