#!/usr/bin/env bash
# A real static HTTP server with Range requests, for a published copy (`ledger publish DIR`) read by
# DuckDB's httpfs (`ledger query --remote URL --direct`): Debian's nginx-light, one process running as
# the caller, its config, pid, logs and temp folders all in a folder of the caller's (a test's tmp dir).
# Python's http.server does not answer Range requests; DuckDB needs them to read Parquet by URL.
#
#   scripts/http.sh install                 apt-get install nginx-light when missing; tolerant (a Makefile
#                                           prerequisite): when it cannot, it says why and exits 0, and the
#                                           tests that need it skip with that reason
#   scripts/http.sh start DIR ROOT [PORT]   serve folder ROOT on 127.0.0.1:PORT (a free port if none);
#                                           waits until it answers, then prints its base URL
#   scripts/http.sh start-norange DIR ROOT [PORT]
#                                           the same, with Range requests turned off (max_ranges 0)
#   scripts/http.sh stop DIR                stop the server started in DIR
set -euo pipefail

START_TIMEOUT_S=10
NGINX="${NGINX:-$(command -v nginx || echo /usr/sbin/nginx)}"

install() {
  if [[ -x "$NGINX" ]]; then
    return 0
  fi
  if [[ "$(id -u)" != 0 ]]; then
    echo "http.sh: nginx missing and not root: run 'apt-get install nginx-light' (its tests will skip)" >&2
    return 0
  fi
  command -v apt-get >/dev/null || { echo "http.sh: no apt-get here (the nginx tests will skip)" >&2; return 0; }
  if ! { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
    nginx-light >/dev/null; }; then
    echo "http.sh: apt-get install nginx-light failed (the nginx tests will skip)" >&2
  fi
  return 0
}

free_port() {
  python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'
}

write_config() {
  local dir="$1" root="$2" port="$3" ranges="$4"
  mkdir -p "$dir/tmp"
  cat >"$dir/nginx.conf" <<EOF
daemon off;
master_process off;
worker_processes 1;
pid $dir/nginx.pid;
error_log $dir/error.log warn;
events { worker_connections 256; }
http {
  access_log $dir/access.log;
  client_body_temp_path $dir/tmp/body;
  proxy_temp_path $dir/tmp/proxy;
  fastcgi_temp_path $dir/tmp/fastcgi;
  uwsgi_temp_path $dir/tmp/uwsgi;
  scgi_temp_path $dir/tmp/scgi;
  types { application/octet-stream parquet; text/plain sql json sig; }
  default_type application/octet-stream;
  server {
    listen 127.0.0.1:$port;
    root $root;
    $ranges
    location = /checkpoint { add_header Cache-Control "no-cache"; }
  }
}
EOF
}

answers() {
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
  local dir="$1" root="$2" port="${3:-}" ranges="${4:-}"
  [[ -x "$NGINX" ]] || { echo "http.sh: no nginx here: run scripts/http.sh install" >&2; exit 1; }
  mkdir -p "$dir" "$root"
  [[ -n "$port" ]] || port="$(free_port)"
  write_config "$dir" "$(cd "$root" && pwd)" "$port" "$ranges"
  nohup "$NGINX" -c "$dir/nginx.conf" -e "$dir/error.log" >>"$dir/nginx.out" 2>&1 </dev/null &
  echo $! >"$dir/server.pid"
  local waited=0
  until answers "http://127.0.0.1:$port/"; do
    if ! kill -0 "$(cat "$dir/server.pid")" 2>/dev/null; then
      echo "http.sh: nginx exited at start:" >&2
      tail -5 "$dir/error.log" "$dir/nginx.out" >&2 || true
      exit 1
    fi
    if ((waited >= START_TIMEOUT_S * 10)); then
      echo "http.sh: nginx did not answer on 127.0.0.1:$port within ${START_TIMEOUT_S}s" >&2
      stop "$dir"
      exit 1
    fi
    sleep 0.1
    waited=$((waited + 1))
  done
  echo "http://127.0.0.1:$port/"
}

stop() {
  local dir="$1"
  [[ -f "$dir/server.pid" ]] || return 0
  local pid
  pid="$(cat "$dir/server.pid")"
  if kill "$pid" 2>/dev/null; then
    for _ in $(seq 50); do
      kill -0 "$pid" 2>/dev/null || break
      sleep 0.1
    done
    kill -0 "$pid" 2>/dev/null && kill -9 "$pid" 2>/dev/null
  fi
  rm -f "$dir/server.pid"
}

case "${1:-}" in
  install) install ;;
  start) start "$2" "$3" "${4:-}" ;;
  start-norange) start "$2" "$3" "${4:-}" "max_ranges 0;" ;;
  stop) stop "$2" ;;
  *) echo "usage: $0 install | start DIR ROOT [PORT] | start-norange DIR ROOT [PORT] | stop DIR" >&2; exit 2 ;;
esac
