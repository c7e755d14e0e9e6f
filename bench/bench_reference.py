"""The reference run at 10%, 30% and 100% of its size: emit → ledger, then the analysts' questions.

For each size (a fraction of ``--steps``, 390,000 by default), in one run:

* emit: ``ledger simulate reference-535b`` into a fresh spool (a subprocess: seconds, peak RSS);
* ingest: ``ledger ingest spool`` into a fresh ledger (a subprocess: seconds, values/s, events/s, its
  own peak RSS, from GNU time: ``bench.measure``);
* bytes: spool, ledger, ledger bytes per value;
* the analysts' questions through the public API (``runledger.ledger.query.Reader``), each beside the
  same answer from a plain DuckDB scan of the ledger's Parquet files (which must agree): state at
  mid-run, one metric's full series, mean drop rate per layer over a 1,000-step window, history,
  diff, blame, the slowest rank per logged step, crashes by kind and host. Times are the median of 3
  calls after one untimed call.

``--kafka`` instead produces into a real broker (``scripts/kafka.sh`` via tests.support.kafka; or
``RUNLEDGER_KAFKA_BOOTSTRAP``), ingests with the consumer-group ingester (``ledger ingest kafka``)
and rebuilds a fresh ledger with ``ledger replay``, each a subprocess timed with its peak RSS.

    python -m bench.bench_reference                          # 10%, 30%, 100% (~15+ min on 2 cores)
    python -m bench.bench_reference --fractions 0.1,0.3
    python -m bench.bench_reference --steps 20000 --fractions 0.5,1   # a quick run
    python -m bench.bench_reference --kafka --fractions 0.1
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import duckdb

from bench import measure
from bench.measure import Measured
from runledger.ingest.kafka_sink import UNDELIVERED_EXIT_CODE
from runledger.ledger.fold import STATE_TYPES
from runledger.ledger.query import Reader
from runledger.workflows.simulate import REFERENCE_STEPS, RUN_ID

LEDGER_CLI = [sys.executable, "-m", "runledger.cli.main"]


def run_measured(
    cmd: list[str], log: Path, env: dict[str, str] | None = None, *, allowed_exits: tuple[int, ...] = (0,)
) -> Measured:
    """Run ``cmd`` to completion: its wall time, CPU time and its own peak RSS (``bench.measure``).
    ``allowed_exits``: the exit statuses that are not an error (3: events left in the outage spool)."""
    proc = measure.run_measured(cmd, stderr=log, env=env)
    if proc.returncode not in allowed_exits:
        raise RuntimeError(f"{' '.join(cmd)} exited {proc.returncode}; see {log}")
    return proc


def tree_bytes(path: Path, pattern: str = "*") -> int:
    return sum(p.stat().st_size for p in path.rglob(pattern) if p.is_file())


def timed(fn: Callable[[], Any], repeat: int = 3) -> tuple[float, Any]:
    """Median milliseconds of ``repeat`` calls after one untimed call, and the answer."""
    answer = fn()
    times = []
    for _ in range(repeat):
        t = time.perf_counter()
        answer = fn()
        times.append((time.perf_counter() - t) * 1000)
    return statistics.median(times), answer


# --- the plain DuckDB scans: the same answers without runledger's views or fold -------------------


class Plain:
    def __init__(self, ledger: Path) -> None:
        self.root = ledger
        self.con = duckdb.connect()

    def t(self, table: str) -> str:
        part = "stream_type" if table == "events" else "run_id"
        return (
            f"read_parquet('{self.root}/{table}/*/*.parquet', hive_partitioning=true, "
            f"hive_types={{'{part}': VARCHAR}})"
        )

    def rows(self, sql: str, params: list[Any]) -> list[tuple[Any, ...]]:
        return self.con.execute(sql, params).fetchall()

    def state(self, step: int) -> tuple[str, int]:
        """(config hash, attempt) live at ``step`` on the final lineage."""
        return self.rows(
            f"""
            WITH l AS (SELECT attempt, coalesce(from_checkpoint_step, 0) AS start_step
                       FROM {self.t("launches")} WHERE run_id = $1),
                 cut AS (SELECT a.attempt, (SELECT min(b.start_step) FROM l b WHERE b.attempt > a.attempt) AS cutoff
                         FROM l a),
                 cover AS (SELECT coalesce(max(attempt) FILTER (WHERE start_step < $2), min(attempt)) AS attempt FROM l)
            SELECT c.config_hash, (SELECT attempt FROM cover)
            FROM {self.t("configs")} c JOIN cut USING (attempt)
            WHERE c.run_id = $1 AND c.step <= $2 AND (cut.cutoff IS NULL OR c.step <= cut.cutoff)
              AND c.attempt <= (SELECT attempt FROM cover)
            ORDER BY c.step DESC, c.attempt DESC, c.stream_seq DESC LIMIT 1
            """,
            [RUN_ID, step],
        )[0]

    def series(self, name: str) -> list[tuple[Any, ...]]:
        return self.rows(
            f"SELECT step, arg_max(value, attempt) FROM {self.t('metrics')} WHERE run_id = $1 AND name = $2 "
            "GROUP BY step ORDER BY step",
            [RUN_ID, name],
        )

    def series_arrow(self, name: str) -> Any:
        return self.con.sql(
            f"SELECT step, arg_max(value, attempt) FROM {self.t('metrics')} WHERE run_id = $1 AND name = $2 "
            "GROUP BY step ORDER BY step",
            params=[RUN_ID, name],
        ).to_arrow_table()

    def drop_window(self, lo: int, hi: int) -> list[tuple[Any, ...]]:
        return self.rows(
            f"SELECT layer, avg(rate) FROM (SELECT step, layer, arg_max(token_drop_rate, attempt) AS rate "
            f"FROM {self.t('moe_layer_stats')} WHERE run_id = $1 AND step BETWEEN $2 AND $3 GROUP BY step, layer) "
            "GROUP BY layer ORDER BY layer",
            [RUN_ID, lo, hi],
        )

    def history_count(self) -> int:
        marks = ", ".join(f"'{t}'" for t in STATE_TYPES)
        return self.rows(
            f"SELECT count(*) FROM {self.t('events')} WHERE stream = $1 AND type IN ({marks})", [RUN_ID]
        )[0][0]

    def blame_step(self, key_path: str, step: int) -> int:
        return self.rows(
            f"SELECT coalesce(max(step), 0) FROM {self.t('config_changes')} WHERE run_id = $1 AND accepted "
            "AND step <= $2 AND contains(patch, $3)",
            [RUN_ID, step, f'"{key_path}"'],
        )[0][0]

    def slowest_ranks(self) -> list[tuple[Any, ...]]:
        return self.rows(
            f"SELECT step, attempt, arg_max(rank, step_time_s) FROM {self.t('rank_stats')} WHERE run_id = $1 "
            "GROUP BY step, attempt ORDER BY step, attempt",
            [RUN_ID],
        )

    def crashes(self) -> list[tuple[Any, ...]]:
        return self.rows(
            f"SELECT kind, host, count(*) FROM {self.t('incidents')} WHERE run_id = $1 AND kind <> 'skipped' "
            "GROUP BY ALL ORDER BY ALL",
            [RUN_ID],
        )


def questions(ledger: Path, steps: int, switch_step: int) -> dict[str, tuple[float, float, bool]]:
    """Each question: (ms through Reader, ms by the plain scan, answers agree)."""
    reader = Reader(ledger)
    plain = Plain(ledger)
    mid = steps // 2
    window = (mid, mid + 999)
    out: dict[str, tuple[float, float, bool]] = {}

    def both(
        name: str, api: Callable[[], Any], raw: Callable[[], Any], same: Callable[[Any, Any], bool]
    ) -> None:
        api_ms, a = timed(api)
        raw_ms, b = timed(raw)
        out[name] = (api_ms, raw_ms, bool(same(a, b)))

    both(
        f"state --step {mid} (ms)",
        lambda: reader.state(RUN_ID, step=mid),
        lambda: plain.state(mid),
        lambda a, b: (a.config_hash, a.attempt) == b,
    )
    both(
        "one metric's full series, as Arrow (ms)",
        lambda: reader.arrow(
            "SELECT step, value FROM metrics WHERE run_id = ? AND name = 'loss' ORDER BY step", [RUN_ID]
        ),
        lambda: plain.series_arrow("loss"),
        lambda a, b: a.column("step").equals(b.column(0)) and a.column("value").equals(b.column(1)),
    )
    both(
        "one metric's full series, as Python tuples (ms)",
        lambda: (
            reader.sql(
                "SELECT step, value FROM metrics WHERE run_id = ? AND name = 'loss' ORDER BY step", [RUN_ID]
            ).rows
        ),
        lambda: plain.series("loss"),
        lambda a, b: a == b and len(a) == steps,
    )
    both(
        "mean drop per layer, 1,000-step window (ms)",
        lambda: (
            reader.sql(
                "SELECT layer, avg(token_drop_rate) FROM moe_layer_stats WHERE run_id = ? AND step BETWEEN ? AND ? "
                "GROUP BY layer ORDER BY layer",
                [RUN_ID, *window],
            ).rows
        ),
        lambda: plain.drop_window(*window),
        lambda a, b: (
            len(a) == len(b) == 48
            and all(x[0] == y[0] and abs(x[1] - y[1]) < 1e-12 for x, y in zip(a, b, strict=False))
        ),
    )
    both(
        "history (ms)",
        lambda: reader.history(RUN_ID),
        plain.history_count,
        lambda a, b: sum(1 for i in a if i.kind != "github") == b,
    )
    both(
        f"diff {mid - 1000}..{mid + 1000} (ms)",
        lambda: reader.diff(RUN_ID, mid - 1000, mid + 1000),
        lambda: (plain.state(mid - 1000), plain.state(mid + 1000)),
        lambda a, b: (a["from"]["config_hash"], a["to"]["config_hash"]) == (b[0][0], b[1][0]),
    )
    both(
        f"blame moe.dispatcher --step {mid} (ms)",
        lambda: reader.blame(RUN_ID, "moe.dispatcher", step=mid),
        lambda: plain.blame_step("/moe/dispatcher", mid),
        lambda a, b: a["set_by"]["step"] == b and (mid < switch_step or b == switch_step),
    )
    both(
        "slowest rank per logged step (ms)",
        lambda: (
            reader.sql(
                "SELECT step, attempt, arg_max(rank, step_time_s) FROM rank_stats WHERE run_id = ? "
                "GROUP BY step, attempt ORDER BY step, attempt",
                [RUN_ID],
            ).rows
        ),
        plain.slowest_ranks,
        lambda a, b: a == b and len(a) > 0,
    )
    both(
        "crashes by kind and host (ms)",
        lambda: (
            reader.sql(
                "SELECT kind, host, count(*) FROM crashes WHERE run_id = ? GROUP BY ALL ORDER BY ALL",
                [RUN_ID],
            ).rows
        ),
        plain.crashes,
        lambda a, b: a == b and len(a) > 0,
    )
    return out


# --- one size -------------------------------------------------------------------------------------


@dataclass
class Size:
    steps: int
    figures: dict[str, str] = field(default_factory=dict)


def simulate_cmd(steps: int, spool: Path, extra: list[str]) -> list[str]:
    return [*LEDGER_CLI, "simulate", "reference-535b", "--steps", str(steps), "--spool", str(spool), *extra]


def spool_size(work: Path, steps: int, log: Path) -> Size:
    size = Size(steps)
    f = size.figures
    spool, ledger = work / "spool", work / "ledger"
    emit = run_measured(simulate_cmd(steps, spool, []), log)
    emitted = json.loads(emit.stdout)
    ingest = run_measured(
        [*LEDGER_CLI, "ingest", "spool", "--spool", str(spool), "--ledger", str(ledger)], log
    )
    values, events = emitted["values"], emitted["events"]
    ledger_bytes = tree_bytes(ledger)
    f["events"] = f"{events:,}"
    f["values"] = f"{values:,}"
    f["emit s (simulate's own)"] = f"{emitted['seconds']:.1f}"
    f["emit CPU s"] = f"{emit.cpu_s:.1f}"
    f["emit peak RSS MB"] = f"{emit.peak_rss_mb:.0f}"
    f["spool → ledger s"] = f"{ingest.seconds:.1f}"
    f["spool → ledger CPU s"] = f"{ingest.cpu_s:.1f}"
    f["values/s"] = f"{values / ingest.seconds:,.0f}"
    f["events/s"] = f"{events / ingest.seconds:,.0f}"
    f["ingest peak RSS MB"] = f"{ingest.peak_rss_mb:.0f}"
    f["spool MB"] = f"{tree_bytes(spool, '*.seg') / 1e6:,.0f}"
    f["ledger MB"] = f"{ledger_bytes / 1e6:,.0f}"
    f["ledger bytes/value"] = f"{ledger_bytes / values:.2f}"
    shutil.rmtree(spool)  # the disk holds one size at a time
    print(f"  {json.dumps(f)}", flush=True)
    add_questions(size, ledger, emitted["switch_step"])
    return size


def kafka_size(work: Path, steps: int, log: Path, bootstrap: str) -> Size:
    from kafka.admin import KafkaAdminClient, NewTopic

    size = Size(steps)
    f = size.figures
    prefix = f"benchref{uuid.uuid4().hex[:8]}."
    env = {**os.environ, "RUNLEDGER_KAFKA_TOPIC_PREFIX": prefix}
    admin = KafkaAdminClient(bootstrap_servers=bootstrap)
    admin.create_topics([NewTopic(prefix + "events", 4, 1), NewTopic(prefix + "deadletter", 1, 1)])
    admin.close()
    cmd = simulate_cmd(steps, work / "outage-spool", ["--bus", "kafka", "--bootstrap", bootstrap])
    produce = run_measured(cmd, log, env, allowed_exits=(0, UNDELIVERED_EXIT_CODE))
    emitted = json.loads(produce.stdout)
    # A producer that outruns the broker spools; what close() could not hand over in its 10 s is
    # sent the documented way for a producer that has exited.
    drained_s = 0.0
    if emitted["undelivered"]:
        drain = run_measured(
            [
                *LEDGER_CLI,
                "kafka",
                "drain-spool",
                "--spool",
                str(work / "outage-spool"),
                "--bootstrap",
                bootstrap,
                "--timeout",
                "900",
            ],
            log,
            env,
        )
        drained_s = drain.seconds
    ledger = work / "ledger"
    idle_s = 10.0
    ingest = run_measured(
        [
            *LEDGER_CLI,
            "ingest",
            "kafka",
            "--bootstrap",
            bootstrap,
            "--group",
            f"{prefix}ingest",
            "--ledger",
            str(ledger),
            "--until-idle",
            str(idle_s),
        ],
        log,
        env,
    )
    replay = run_measured(
        [*LEDGER_CLI, "replay", "--bootstrap", bootstrap, "--to", str(work / "replayed")], log, env
    )
    values, events = emitted["values"], emitted["events"]
    ingest_s = ingest.seconds - idle_s
    f["events"] = f"{events:,}"
    f["values"] = f"{values:,}"
    f["produce to Kafka s"] = f"{produce.seconds:.1f} (+ drain {drained_s:.1f})"
    f["produce CPU s"] = f"{produce.cpu_s:.1f}"
    f["producer peak RSS MB"] = f"{produce.peak_rss_mb:.0f}"
    f["ingest kafka s (less idle wait)"] = f"{ingest_s:.1f}"
    f["ingest kafka CPU s"] = f"{ingest.cpu_s:.1f}"
    f["ingest values/s"] = f"{values / ingest_s:,.0f}"
    f["ingest events/s"] = f"{events / ingest_s:,.0f}"
    f["ingester peak RSS MB"] = f"{ingest.peak_rss_mb:.0f}"
    f["replay s"] = f"{replay.seconds:.1f}"
    f["replay CPU s"] = f"{replay.cpu_s:.1f}"
    f["replay peak RSS MB"] = f"{replay.peak_rss_mb:.0f}"
    f["ledger MB"] = f"{tree_bytes(ledger) / 1e6:,.0f}"
    # Everything produced must be in both ledgers (the sink hands an outage spool over on close).
    for name, path in (("ingested", ledger), ("replayed", work / "replayed")):
        held = Reader(path).sql("SELECT count(*) FROM events").rows[0][0]
        f[f"events {name}"] = f"{held:,}" + ("" if held == events else f" (MISSING {events - held:,})")
    shutil.rmtree(work / "replayed")
    add_questions(size, ledger, emitted["switch_step"])
    return size


def add_questions(size: Size, ledger: Path, switch_step: int) -> None:
    for name, (api_ms, raw_ms, same) in questions(ledger, size.steps, switch_step).items():
        size.figures[name] = f"{api_ms:,.1f} (plain {raw_ms:,.1f}){'' if same else ' DIFFERENT'}"


def print_table(sizes: list[Size], fractions: list[float]) -> None:
    head = ["figure", *(f"{fr:.0%} ({s.steps:,} steps)" for fr, s in zip(fractions, sizes, strict=True))]
    names = list(dict.fromkeys(n for s in sizes for n in s.figures))
    print("| " + " | ".join(head) + " |")
    print("|" + "---|" * len(head))
    for name in names:
        print("| " + " | ".join([name, *(s.figures.get(name, "") for s in sizes)]) + " |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=REFERENCE_STEPS, help="the full run's steps")
    ap.add_argument("--fractions", default="0.1,0.3,1.0", help="sizes, as fractions of --steps")
    ap.add_argument("--kafka", action="store_true", help="produce into Kafka; ingest-kafka and replay")
    ap.add_argument("--workdir", type=Path, help="where the spools and ledgers go (default: a temp dir)")
    ap.add_argument("--keep", action="store_true", help="keep the last size's ledger")
    args = ap.parse_args()
    fractions = [float(x) for x in args.fractions.split(",") if x.strip()]
    base = Path(tempfile.mkdtemp(prefix="bench-reference-", dir=args.workdir))
    log = base / "bench.log"
    print(f"work in {base} (subprocess logs: {log})", flush=True)
    broker = None
    bootstrap = os.environ.get("RUNLEDGER_KAFKA_BOOTSTRAP")
    if args.kafka and not bootstrap:
        from tests.support.kafka import Broker, make_temp_broker_dir

        broker = Broker(make_temp_broker_dir("bench-reference-"))
        bootstrap = broker.start()
    sizes: list[Size] = []
    try:
        for fraction in fractions:
            steps = max(200, round(args.steps * fraction))
            work = base / f"{steps}"
            work.mkdir()
            print(f"{fraction:.0%}: {steps:,} steps …", flush=True)
            t = time.perf_counter()
            if args.kafka:
                assert bootstrap is not None
                size = kafka_size(work, steps, log, bootstrap)
            else:
                size = spool_size(work, steps, log)
            # Question names carry the step they ask about; key them by position for the table.
            size.figures = {_generic(k, steps): v for k, v in size.figures.items()}
            sizes.append(size)
            print(f"  done in {time.perf_counter() - t:.0f} s: {json.dumps(size.figures)}", flush=True)
            if not (args.keep and fraction == fractions[-1]):
                shutil.rmtree(work)
    finally:
        if broker is not None:
            broker.stop()
            shutil.rmtree(broker.dir, ignore_errors=True)  # its topics hold a copy of every size's stream
    print()
    print_table(sizes, fractions)


def _generic(name: str, steps: int) -> str:
    mid = steps // 2
    return name.replace(f"{mid - 1000}..{mid + 1000}", "mid±1000").replace(f"--step {mid}", "--step mid")


if __name__ == "__main__":
    main()
