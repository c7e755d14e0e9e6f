#!/usr/bin/env bash
# Single-node Apache Kafka (KRaft, combined broker+controller) for runledger
# tests and CI. Jars come from Maven Central via scripts/kafka/pom.xml.
#
#   scripts/kafka.sh fetch                   download broker jars (once)
#   scripts/kafka.sh start [--port N] [--controller-port M] [--dir D]
#   scripts/kafka.sh stop|status|restart     [--dir D]
#
# State dir (config, data, log, pid): --dir, else $RUNLEDGER_KAFKA_DIR, else
# <repo>/.kafka. Jars: $RUNLEDGER_KAFKA_LIBS, else <repo>/.kafka/libs (shared
# by every state dir, so side-by-side brokers need only distinct dirs+ports).
# `start` prints KAFKA_BOOTSTRAP=127.0.0.1:PORT on stdout when ready.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
POM="$ROOT/scripts/kafka/pom.xml"
LIBS="${RUNLEDGER_KAFKA_LIBS:-$ROOT/.kafka/libs}"
DIR="${RUNLEDGER_KAFKA_DIR:-$ROOT/.kafka}"
PORT=""
CPORT=""
DEFAULT_PORT=39092
READY_TIMEOUT="${RUNLEDGER_KAFKA_READY_TIMEOUT:-90}"
STOP_TIMEOUT="${RUNLEDGER_KAFKA_STOP_TIMEOUT:-30}"
HEAP="${RUNLEDGER_KAFKA_HEAP:--Xmx512m -Xms128m}"

log() { echo "kafka.sh: $*" >&2; }
die() { log "error: $*"; exit 1; }

usage() {
  sed -n '2,12p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//' >&2
  exit 2
}

cmd="${1:-}"
[ -n "$cmd" ] || usage
shift
while [ $# -gt 0 ]; do
  case "$1" in
    --port) PORT="${2:?--port needs a value}"; shift 2 ;;
    --port=*) PORT="${1#*=}"; shift ;;
    --controller-port) CPORT="${2:?--controller-port needs a value}"; shift 2 ;;
    --controller-port=*) CPORT="${1#*=}"; shift ;;
    --dir) DIR="${2:?--dir needs a value}"; shift 2 ;;
    --dir=*) DIR="${1#*=}"; shift ;;
    -h|--help) usage ;;
    *) die "unknown argument: $1" ;;
  esac
done
mkdir -p "$DIR"
DIR="$(cd "$DIR" && pwd)"
PIDFILE="$DIR/broker.pid"
PORTFILE="$DIR/broker.port"
LOGFILE="$DIR/broker.log"
CONF="$DIR/server.properties"

# ---------------------------------------------------------------- fetch
libs_ok() {
  compgen -G "$LIBS/kafka_2.13-*.jar" >/dev/null &&
    compgen -G "$LIBS/kafka-clients-*.jar" >/dev/null &&
    compgen -G "$LIBS/kafka-tools-[0-9]*.jar" >/dev/null &&
    compgen -G "$LIBS/log4j-core-*.jar" >/dev/null
}

do_fetch() {
  if libs_ok; then return 0; fi
  command -v mvn >/dev/null || die "mvn not found on PATH (needed once to download Kafka jars into $LIBS)"
  command -v java >/dev/null || die "java not found on PATH (Kafka 4 needs Java 17+)"
  log "fetching Kafka jars with Maven into $LIBS (first run only)"
  mkdir -p "$LIBS"
  local out rc=0
  # shellcheck disable=SC2086  # RUNLEDGER_KAFKA_MVN_ARGS: extra args, e.g. "-o" or "-Dmaven.repo.local=..."
  out="$(mvn -q -B -Dstyle.color=never -f "$POM" -Dkafka.libs.dir="$LIBS" ${RUNLEDGER_KAFKA_MVN_ARGS:-} process-resources 2>&1)" || rc=$?
  if [ $rc -ne 0 ] || ! libs_ok; then
    log "maven failed (rc=$rc) fetching jars from $POM:"
    # The [ERROR] lines carry the reason (unresolvable artifact, no network, ...).
    local why
    why="$(printf '%s\n' "$out" | sed 's/\x1b\[[0-9;]*m//g' | grep -E '^\[ERROR\] +[^ ]' |
      grep -vE '^\[ERROR\] +(To see the full|Re-run Maven|For more information|\[Help [0-9]+\])' |
      sed 's/ -> \[Help [0-9]*\]$//' | head -15 || true)"
    if [ -n "$why" ]; then printf '%s\n' "$why" >&2; else printf '%s\n' "$out" | tail -15 >&2; fi
    exit 1
  fi
}

# ---------------------------------------------------------------- helpers
port_open() { (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null; }

broker_pid() {
  # Prints the pid if the pidfile names a live kafka.Kafka for this dir's config.
  [ -f "$PIDFILE" ] || return 1
  local pid
  pid="$(cat "$PIDFILE" 2>/dev/null || true)"
  [ -n "$pid" ] && kill -0 "$pid" 2>/dev/null || return 1
  if [ -r "/proc/$pid/cmdline" ]; then
    tr '\0' ' ' <"/proc/$pid/cmdline" | grep -q -- "kafka.Kafka $CONF" || return 1
  fi
  echo "$pid"
}

load_ports() {
  if [ -z "$PORT" ] && [ -f "$PORTFILE" ]; then
    read -r PORT CPORT_SAVED <"$PORTFILE" || true
    [ -n "$CPORT" ] || CPORT="${CPORT_SAVED:-}"
  fi
  PORT="${PORT:-$DEFAULT_PORT}"
  CPORT="${CPORT:-$((PORT + 1))}"
}

python_bin() {
  if [ -x "$ROOT/.venv/bin/python" ]; then echo "$ROOT/.venv/bin/python"; else command -v python3 || true; fi
}

broker_ready() {
  # Log says the server started, and (if kafka-python is around) an admin
  # client can list topics, i.e. the broker registered and serves metadata.
  grep -q "Kafka Server started" "$LOGFILE" 2>/dev/null || return 1
  port_open "$PORT" || return 1
  local py
  py="$(python_bin)"
  [ -n "$py" ] && "$py" -c 'import kafka' 2>/dev/null || return 0
  "$py" - "127.0.0.1:$PORT" <<'EOF' >/dev/null 2>&1
import sys
from kafka import KafkaAdminClient
a = KafkaAdminClient(bootstrap_servers=sys.argv[1], request_timeout_ms=5000,
                     bootstrap_timeout_ms=5000, client_id="kafka.sh-ready")
try:
    a.list_topics()
finally:
    a.close()
EOF
}

write_config() {
  cat >"$CONF" <<EOF
# Written by scripts/kafka.sh; regenerated on every start.
process.roles=broker,controller
node.id=1
controller.quorum.voters=1@127.0.0.1:$CPORT
listeners=PLAINTEXT://127.0.0.1:$PORT,CONTROLLER://127.0.0.1:$CPORT
advertised.listeners=PLAINTEXT://127.0.0.1:$PORT
listener.security.protocol.map=PLAINTEXT:PLAINTEXT,CONTROLLER:PLAINTEXT
inter.broker.listener.name=PLAINTEXT
controller.listener.names=CONTROLLER
log.dirs=$DIR/data
num.partitions=1
auto.create.topics.enable=true
offsets.topic.replication.factor=1
offsets.topic.num.partitions=4
transaction.state.log.replication.factor=1
transaction.state.log.min.isr=1
share.coordinator.state.topic.replication.factor=1
share.coordinator.state.topic.min.isr=1
group.initial.rebalance.delay.ms=0
num.network.threads=2
num.io.threads=4
num.recovery.threads.per.data.dir=1
log.retention.hours=-1
log.segment.bytes=67108864
delete.topic.enable=true
EOF
  cat >"$DIR/log4j2.properties" <<'EOF'
status = warn
appender.out.type = Console
appender.out.name = OUT
appender.out.layout.type = PatternLayout
appender.out.layout.pattern = [%d] %p %m (%c)%n
rootLogger.level = INFO
rootLogger.appenderRef.out.ref = OUT
logger.kafka.name = kafka
logger.kafka.level = INFO
logger.state.name = state.change.logger
logger.state.level = WARN
logger.request.name = kafka.request.logger
logger.request.level = WARN
logger.clients.name = org.apache.kafka.clients
logger.clients.level = WARN
EOF
}

JAVA_OPTS=(-XX:+UseG1GC -XX:MaxGCPauseMillis=20 -XX:+ExitOnOutOfMemoryError
  -Djava.awt.headless=true -Dlog4j2.configurationFile="$DIR/log4j2.properties")

# ---------------------------------------------------------------- commands
do_start() {
  do_fetch
  local pid
  if pid="$(broker_pid)"; then
    load_ports
    if broker_ready; then
      log "already running (pid $pid)"
      echo "KAFKA_BOOTSTRAP=127.0.0.1:$PORT"
      return 0
    fi
    die "a broker (pid $pid) for $DIR is running but not ready; run: $0 stop --dir $DIR"
  fi
  load_ports
  port_open "$PORT" && die "port $PORT is already in use by another process"
  port_open "$CPORT" && die "controller port $CPORT is already in use by another process"
  mkdir -p "$DIR/data"
  write_config
  echo "$PORT $CPORT" >"$PORTFILE"

  local cp="$LIBS/*"
  if [ ! -f "$DIR/data/meta.properties" ]; then
    if [ ! -s "$DIR/cluster.id" ]; then
      java -cp "$cp" "${JAVA_OPTS[@]}" kafka.tools.StorageTool random-uuid 2>/dev/null \
        | tail -1 >"$DIR/cluster.id.tmp" || die "could not generate a cluster id"
      mv "$DIR/cluster.id.tmp" "$DIR/cluster.id"
    fi
    local fout
    fout="$(java -cp "$cp" "${JAVA_OPTS[@]}" kafka.tools.StorageTool format \
      -t "$(cat "$DIR/cluster.id")" -c "$CONF" --ignore-formatted 2>&1)" \
      || { printf '%s\n' "$fout" >&2; die "storage format failed"; }
  fi

  : >"$LOGFILE"
  # setsid: the broker outlives this script and ignores the caller's ^C.
  local launcher=()
  command -v setsid >/dev/null && launcher=(setsid)
  # shellcheck disable=SC2086
  "${launcher[@]}" java $HEAP "${JAVA_OPTS[@]}" -cp "$cp" kafka.Kafka "$CONF" \
    </dev/null >>"$LOGFILE" 2>&1 &
  pid=$!
  echo "$pid" >"$PIDFILE"

  local deadline=$((SECONDS + READY_TIMEOUT))
  until broker_ready; do
    if ! kill -0 "$pid" 2>/dev/null; then
      log "broker exited during startup; last lines of $LOGFILE:"
      tail -n 40 "$LOGFILE" >&2
      rm -f "$PIDFILE"
      exit 1
    fi
    if [ $SECONDS -ge $deadline ]; then
      log "broker not ready after ${READY_TIMEOUT}s; last lines of $LOGFILE:"
      tail -n 40 "$LOGFILE" >&2
      do_stop >/dev/null 2>&1 || true
      exit 1
    fi
    sleep 0.5
  done
  log "broker ready (pid $pid, dir $DIR)"
  echo "KAFKA_BOOTSTRAP=127.0.0.1:$PORT"
}

do_stop() {
  local pid
  if ! pid="$(broker_pid)"; then
    rm -f "$PIDFILE"
    log "not running ($DIR)"
    return 0
  fi
  kill -TERM "$pid" 2>/dev/null || true
  local deadline=$((SECONDS + STOP_TIMEOUT))
  while kill -0 "$pid" 2>/dev/null; do
    if [ $SECONDS -ge $deadline ]; then
      log "pid $pid ignored SIGTERM for ${STOP_TIMEOUT}s; sending SIGKILL"
      kill -KILL "$pid" 2>/dev/null || true
      sleep 0.5
      break
    fi
    sleep 0.2
  done
  rm -f "$PIDFILE"
  log "stopped (pid $pid)"
}

do_status() {
  local pid
  load_ports
  if pid="$(broker_pid)"; then
    if broker_ready; then
      echo "running pid=$pid KAFKA_BOOTSTRAP=127.0.0.1:$PORT dir=$DIR"
      return 0
    fi
    echo "starting-or-unhealthy pid=$pid port=$PORT dir=$DIR"
    return 1
  fi
  echo "stopped dir=$DIR"
  return 3
}

case "$cmd" in
  fetch) do_fetch; log "jars present in $LIBS" ;;
  start) do_start ;;
  stop) do_stop ;;
  status) do_status ;;
  restart) load_ports; do_stop; do_start ;;
  *) usage ;;
esac
