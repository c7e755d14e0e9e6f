#!/usr/bin/env bash
# A real C2SP tlog-witness for tests and local use: litewitness and witnessctl from
# filippo.io/torchwood v0.6.1, built from the Go module proxy into .go/bin (module and build caches
# under .go/, ignored by git, reused by CI), run on 127.0.0.1 with its Ed25519 key in a dedicated
# ssh-agent that this script starts and stops.
#
#   scripts/witness.sh build                      build litewitness and witnessctl (~2 min the first time)
#   scripts/witness.sh goverify                   build the Go checkers of tests/merkle/go_verify and go_proof
#   scripts/witness.sh add-log DIR ORIGIN VKEY    let the witness in DIR cosign the log ORIGIN signed by VKEY
#   scripts/witness.sh run DIR PORT NAME          run the witness named NAME on 127.0.0.1:PORT (foreground;
#                                                 its log, DIR/litewitness.log, names its vkey once it is up)
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
GO_HOME="$ROOT/.go"
export GOPATH="$GO_HOME/path" GOMODCACHE="$GO_HOME/mod" GOCACHE="$GO_HOME/cache" GOBIN="$GO_HOME/bin"
export GOFLAGS=-modcacherw
TORCHWOOD=filippo.io/torchwood@v0.6.1  # v0.10.0 needs a newer Go than the machines have

build() {
  if [[ -x "$GOBIN/litewitness" && -x "$GOBIN/witnessctl" && -f "$GOBIN/.torchwood-v0.6.1" ]]; then
    return
  fi
  go install "filippo.io/torchwood/cmd/litewitness@${TORCHWOOD#*@}" "filippo.io/torchwood/cmd/witnessctl@${TORCHWOOD#*@}"
  touch "$GOBIN/.torchwood-v0.6.1"
}

# The Go checkers of the tests (torchwood, x/mod, formats): tests/merkle/go_verify (the published
# log) into .go/bin/goverify, tests/merkle/go_proof (tlog-proof files) into .go/bin/goproof.
goverify() {
  (cd "$ROOT/tests/merkle/go_verify" && go build -o "$GOBIN/goverify" .)
  (cd "$ROOT/tests/merkle/go_proof" && go build -o "$GOBIN/goproof" .)
}

add_log() {
  local dir="$1" origin="$2" vkey="$3"
  "$GOBIN/witnessctl" add-log -db "$dir/witness.db" -origin "$origin"
  "$GOBIN/witnessctl" add-key -db "$dir/witness.db" -origin "$origin" -key "$vkey"
}

run() {
  local dir="$1" port="$2" name="$3"
  mkdir -p "$dir"
  [[ -f "$dir/witness_key" ]] || ssh-keygen -q -t ed25519 -N '' -C "$name" -f "$dir/witness_key"
  local fingerprint agent_pid witness_pid=""
  fingerprint="$(ssh-keygen -l -E sha256 -f "$dir/witness_key.pub" | awk '{print $2}')"
  rm -f "$dir/agent.sock"
  agent_pid="$(ssh-agent -a "$dir/agent.sock" | sed -n 's/^SSH_AGENT_PID=\([0-9]*\);.*/\1/p')"
  # On any exit (the test's SIGTERM included): stop the witness, then the agent holding its key.
  trap '[[ -n "$witness_pid" ]] && kill "$witness_pid" 2>/dev/null; kill "$agent_pid" 2>/dev/null; wait 2>/dev/null' EXIT
  trap 'exit 0' TERM INT
  SSH_AUTH_SOCK="$dir/agent.sock" ssh-add -q "$dir/witness_key"
  "$GOBIN/litewitness" -name "$name" -db "$dir/witness.db" -ssh-agent "$dir/agent.sock" \
    -key "$fingerprint" -listen "127.0.0.1:$port" 2>>"$dir/litewitness.log" &
  witness_pid=$!
  wait "$witness_pid"
}

case "${1:-}" in
  build) build ;;
  goverify) goverify ;;
  add-log) build; add_log "$2" "$3" "$4" ;;
  run) build; run "$2" "$3" "$4" ;;
  *) echo "usage: $0 build | goverify | add-log DIR ORIGIN VKEY | run DIR PORT NAME" >&2; exit 2 ;;
esac
