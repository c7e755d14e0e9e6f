#!/usr/bin/env bash
# A real S3-compatible server for tests and local use: versitygw (github.com/versity/versitygw,
# Apache-2.0), a gateway that serves a POSIX folder over the S3 API. Built from the Go module proxy
# into .go/bin (module and build caches under .go/, ignored by git), run on 127.0.0.1 with root
# credentials generated per server folder. Not a mock of AWS: it signs, checks and stores like one.
#
#   scripts/s3.sh build            build versitygw (a few minutes the first time, cached after)
#   scripts/s3.sh start DIR [PORT] serve DIR/buckets on 127.0.0.1:PORT (a free port if none, or the one
#                                  DIR was last started on); credentials in DIR/s3.env; waits until it
#                                  answers, then prints the env lines (as `env` does)
#   scripts/s3.sh stop DIR         stop the server started in DIR (and wait until it has exited)
#   scripts/s3.sh env DIR          print `export AWS_ENDPOINT_URL=… AWS_ACCESS_KEY_ID=…` lines for DIR
#
# A bucket is made through the S3 API (CreateBucket), e.g. by pyarrow.fs.S3FileSystem.create_dir.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
GO_HOME="$ROOT/.go"
export GOPATH="$GO_HOME/path" GOMODCACHE="$GO_HOME/mod" GOCACHE="$GO_HOME/cache" GOBIN="$GO_HOME/bin"
export GOFLAGS=-modcacherw
VERSITYGW=v1.8.0  # the only version the module proxy lists; its go.mod needs go 1.25
BINARY="$GOBIN/versitygw"
START_TIMEOUT_S=20

build() {
  if [[ -x "$BINARY" && -f "$GOBIN/.versitygw-$VERSITYGW" ]]; then
    return
  fi
  go install "github.com/versity/versitygw/cmd/versitygw@$VERSITYGW"
  touch "$GOBIN/.versitygw-$VERSITYGW"
}

free_port() {
  python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'
}

# DIR/s3.env: made once per folder (a restarted server keeps its port and credentials).
make_env() {
  local dir="$1" port="$2"
  if [[ -f "$dir/s3.env" ]]; then
    return
  fi
  [[ -n "$port" ]] || port="$(free_port)"
  local access secret
  access="RL$(head -c 9 /dev/urandom | od -An -tx1 | tr -d ' \n' | tr a-f A-F)"
  secret="$(head -c 30 /dev/urandom | base64 | tr -d '/+=\n')"
  umask 077
  cat >"$dir/s3.env" <<EOF
export AWS_ENDPOINT_URL=http://127.0.0.1:$port
export AWS_ACCESS_KEY_ID=$access
export AWS_SECRET_ACCESS_KEY=$secret
export AWS_REGION=us-east-1
EOF
}

answers() {
  # Any HTTP status (403 for an unsigned request) means the server is up.
  python3 - "$1" <<'EOF'
import sys, urllib.error, urllib.request
try:
    urllib.request.urlopen(sys.argv[1], timeout=1)
except urllib.error.HTTPError:
    pass
except OSError:
    sys.exit(1)
EOF
}

start() {
  local dir="$1" port="${2:-}"
  mkdir -p "$dir/buckets"
  make_env "$dir" "$port"
  # shellcheck disable=SC1091
  source "$dir/s3.env"
  if [[ -f "$dir/versitygw.pid" ]] && kill -0 "$(cat "$dir/versitygw.pid")" 2>/dev/null; then
    echo "s3.sh: a server is already running for $dir (pid $(cat "$dir/versitygw.pid"))" >&2
    exit 1
  fi
  local listen="${AWS_ENDPOINT_URL#http://}"
  ROOT_ACCESS_KEY_ID="$AWS_ACCESS_KEY_ID" ROOT_SECRET_ACCESS_KEY="$AWS_SECRET_ACCESS_KEY" \
    nohup "$BINARY" --port "$listen" --region "$AWS_REGION" posix "$dir/buckets" \
    >>"$dir/versitygw.log" 2>&1 </dev/null &
  echo $! >"$dir/versitygw.pid"
  local waited=0
  until answers "$AWS_ENDPOINT_URL/"; do
    if ! kill -0 "$(cat "$dir/versitygw.pid")" 2>/dev/null; then
      echo "s3.sh: versitygw exited at start; its log, $dir/versitygw.log, ends:" >&2
      tail -5 "$dir/versitygw.log" >&2
      exit 1
    fi
    if ((waited >= START_TIMEOUT_S * 10)); then
      echo "s3.sh: versitygw did not answer on $AWS_ENDPOINT_URL within ${START_TIMEOUT_S}s" >&2
      stop "$dir"
      exit 1
    fi
    sleep 0.1
    waited=$((waited + 1))
  done
  cat "$dir/s3.env"
}

stop() {
  local dir="$1"
  [[ -f "$dir/versitygw.pid" ]] || return 0
  local pid
  pid="$(cat "$dir/versitygw.pid")"
  if kill "$pid" 2>/dev/null; then
    for _ in $(seq 100); do
      kill -0 "$pid" 2>/dev/null || break
      sleep 0.1
    done
    kill -0 "$pid" 2>/dev/null && kill -9 "$pid" 2>/dev/null
  fi
  rm -f "$dir/versitygw.pid"
}

case "${1:-}" in
  build) build ;;
  start) [[ -x "$BINARY" ]] || build; start "$2" "${3:-}" ;;
  stop) stop "$2" ;;
  env) cat "$2/s3.env" ;;
  *) echo "usage: $0 build | start DIR [PORT] | stop DIR | env DIR" >&2; exit 2 ;;
esac
