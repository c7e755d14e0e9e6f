#!/usr/bin/env bash
# A throw-away PostgreSQL (Debian's package) for a DuckLake catalog: tests, benches, a lab's first try.
#
#   scripts/postgres.sh start DIR    initdb a cluster in DIR (once), start it on 127.0.0.1:<free port>
#   scripts/postgres.sh stop DIR     stop it (fast shutdown; waits)
#   scripts/postgres.sh env DIR      print the DSN: PG_DSN='dbname=ledger host=127.0.0.1 port=N user=postgres'
#   scripts/postgres.sh status DIR   exit 0 if it answers, 1 if not
#
# The server listens on loopback only, with trust auth for local connections (a test cluster, never
# a production one). PostgreSQL refuses to run as root: as root the cluster is owned by and run as
# the Debian `postgres` user (runuser). When the binaries are missing, `start` installs the Debian
# `postgresql` package (apt-get) and exits non-zero with the reason when it cannot.
set -euo pipefail

log() { echo "postgres.sh: $*" >&2; }
die() { log "error: $*"; exit 1; }
usage() { sed -n '2,12p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//' >&2; exit 2; }

cmd="${1:-}"
DIR="${2:-}"
[ -n "$cmd" ] && [ -n "$DIR" ] || usage
READY_TIMEOUT_S="${RUNLEDGER_PG_READY_TIMEOUT_S:-60}"
DB="${RUNLEDGER_PG_DB:-ledger}"

bindir() {
  local d
  for d in /usr/lib/postgresql/*/bin; do
    [ -x "$d/pg_ctl" ] && { echo "$d"; return 0; }
  done
  return 1
}

ensure_installed() {
  bindir >/dev/null && return 0
  command -v apt-get >/dev/null || die "PostgreSQL is not installed and there is no apt-get to install it"
  [ "$(id -u)" -eq 0 ] || die "PostgreSQL is not installed and installing it needs root (apt-get install postgresql)"
  log "installing Debian's postgresql package (not found under /usr/lib/postgresql)"
  local out
  if ! out="$( (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq postgresql) 2>&1)"; then
    die "apt-get install postgresql failed: $(printf '%s\n' "$out" | grep -E '^(E|W):' | head -3 | tr '\n' ' ')"
  fi
  bindir >/dev/null || die "apt-get installed postgresql but no pg_ctl under /usr/lib/postgresql/*/bin"
}

# Run a command as the cluster's owner: ourselves, or `postgres` when we are root.
as_owner() {
  if [ "$(id -u)" -eq 0 ]; then
    runuser -u postgres -- "$@"
  else
    "$@"
  fi
}

free_port() {
  python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1]); s.close()'
}

superuser() { if [ "$(id -u)" -eq 0 ]; then echo postgres; else id -un; fi; }

dsn() {
  local port
  port="$(cat "$DIR/port" 2>/dev/null)" || die "no cluster started in $DIR (run: scripts/postgres.sh start $DIR)"
  echo "dbname=$DB host=127.0.0.1 port=$port user=$(superuser)"
}

answers() {
  local bin port
  bin="$(bindir)" || return 1
  port="$(cat "$DIR/port" 2>/dev/null)" || return 1
  "$bin/pg_isready" -q -h 127.0.0.1 -p "$port" -t 2
}

do_start() {
  ensure_installed
  local bin port
  bin="$(bindir)"
  mkdir -p "$DIR"
  DIR="$(cd "$DIR" && pwd)"
  if [ "$(id -u)" -eq 0 ]; then
    id postgres >/dev/null 2>&1 || die "as root the cluster runs as user postgres, and there is none"
    chown postgres: "$DIR"
  fi
  if answers; then dsn; return 0; fi
  if [ ! -f "$DIR/data/PG_VERSION" ]; then
    as_owner "$bin/initdb" -D "$DIR/data" -A trust -U "$(superuser)" -E UTF8 --no-sync >"$DIR/initdb.log" 2>&1 ||
      die "initdb failed: $(tail -3 "$DIR/initdb.log" | tr '\n' ' ')"
  fi
  port="$(free_port)"
  echo "$port" >"$DIR/port"
  # The socket directory inside DIR: /var/run/postgresql may not exist or be writable.
  as_owner "$bin/pg_ctl" -D "$DIR/data" -l "$DIR/server.log" -w -t "$READY_TIMEOUT_S" \
    -o "-c listen_addresses=127.0.0.1 -p $port -k $DIR -c max_connections=200 -c fsync=on" start >/dev/null ||
    die "server did not start: $(tail -3 "$DIR/server.log" | tr '\n' ' ')"
  if ! as_owner "$bin/psql" -h 127.0.0.1 -p "$port" -U "$(superuser)" -d postgres -tAc \
    "SELECT 1 FROM pg_database WHERE datname = '$DB'" | grep -q 1; then
    as_owner "$bin/createdb" -h 127.0.0.1 -p "$port" -U "$(superuser)" "$DB" || die "createdb $DB failed"
  fi
  dsn
}

do_stop() {
  local bin
  bin="$(bindir)" || return 0
  [ -f "$DIR/data/postmaster.pid" ] || return 0
  as_owner "$bin/pg_ctl" -D "$DIR/data" -m fast -w -t 30 stop >/dev/null
}

case "$cmd" in
  start) do_start ;;
  stop) do_stop ;;
  env) d="$(dsn)" || exit 1; echo "PG_DSN='$d'" ;;
  status) answers ;;
  -h|--help) usage ;;
  *) die "unknown command: $cmd" ;;
esac
