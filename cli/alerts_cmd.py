"""`ledger alerts deliver|list`: the ledger's anomalies, listed or delivered to an alert webhook
(``runledger.ledger.alerts``: a Slack-compatible JSON POST per anomaly, at least once, in order)."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from runledger.cli.output import (
    DEFAULT_LEDGER,
    FormatOption,
    FullOption,
    LedgerOption,
    LimitOption,
    OutputOption,
    console,
    err_console,
    plural,
    print_rows,
    user_errors,
)

if TYPE_CHECKING:
    from runledger.ledger.alerts import Anomaly

alerts_app = typer.Typer(
    help="Anomalies the ledger recorded: list them, or deliver them to an alert webhook.",
    no_args_is_help=True,
)


def deliver(
    url: Annotated[
        str,
        typer.Option(
            "--url", help="The webhook to POST to (http or https; a Slack incoming webhook works as is)."
        ),
    ],
    ledger: LedgerOption = DEFAULT_LEDGER,
    cursor: Annotated[
        Path | None,
        typer.Option(
            "--cursor",
            help="The file keeping the last anomaly delivered (default: LEDGER/.alerts/<hash of the URL>.json).",
        ),
    ] = None,
    follow: Annotated[
        bool, typer.Option("--follow", help="Keep delivering new anomalies until Ctrl-C (exit 130).")
    ] = False,
    interval: Annotated[
        float,
        typer.Option("--interval", min=0.01, help="With --follow: seconds between looks at the ledger."),
    ] = 2.0,
    timeout: Annotated[
        float,
        typer.Option("--timeout", min=0.01, help="Seconds each connect, send and read of a POST may take."),
    ] = 10.0,
    tries: Annotated[
        int,
        typer.Option("--tries", min=1, help="POSTs of one anomaly before giving up (5xx, 429, no answer)."),
    ] = 6,
) -> None:
    """POST every anomaly not yet delivered, in order, as Slack-compatible JSON.

    Each POST carries the anomaly's event id as `Idempotency-Key`; the cursor moves only after a
    2xx, so a kill re-sends at most the anomaly in flight. A 5xx, a 429 (its Retry-After honoured)
    or no answer is retried with backoff; any other status stops with one line, the cursor unmoved.
    Example: ledger alerts deliver --url https://hooks.slack.com/services/T0/B0/XYZ --follow
    """
    from runledger.ledger.alerts import RetryPolicy, deliver_alerts, follow_alerts, parse_webhook

    policy = RetryPolicy(timeout_s=timeout, max_tries=tries)
    with user_errors(ledger):
        shown = parse_webhook(url).shown
        if follow:
            follow_alerts(ledger, url, cursor, interval_s=interval, policy=policy, on_delivered=_said)
            return  # (only an interruption ends a follow without an error)
        report = deliver_alerts(ledger, url, cursor, policy=policy, on_delivered=_said)
    console.print(
        f"{plural(report.delivered, 'anomaly', 'anomalies')} delivered to {shown} "
        f"({plural(report.posts, 'POST')}); cursor at position {report.cursor.position}",
        highlight=False,
        markup=False,
    )


def _said(anomaly: Anomaly) -> None:
    """One line per anomaly delivered (a follow's only output)."""
    console.print(
        f"delivered {anomaly.rule or 'redacted'} run {anomaly.run_id} step {anomaly.step} ({anomaly.event_id})",
        highlight=False,
        markup=False,
    )


def list_anomalies(
    ledger: LedgerOption = DEFAULT_LEDGER,
    run: Annotated[str | None, typer.Option("--run", help="Only this run's anomalies.")] = None,
    rule: Annotated[
        str | None, typer.Option("--rule", help="Only this rule's (loss-spike, non-finite, …).")
    ] = None,
    fmt: FormatOption = None,
    output: OutputOption = None,
    limit: LimitOption = None,
    full: FullOption = False,
) -> None:
    """The anomalies the ledger recorded, in the order they were recorded (the order `deliver` sends).

    Example: ledger alerts list --run moe-535b --rule loss-spike
    """
    from runledger.ledger.alerts import read_anomalies
    from runledger.ledger.query import Reader

    with user_errors(ledger):
        reader = Reader(ledger)
        try:
            found = read_anomalies(reader, run_id=run, rule=rule)
        finally:
            reader.close()
    columns = [
        "position",
        "time",
        "run_id",
        "attempt",
        "step",
        "rule",
        "metric",
        "value",
        "baseline",
        "score",
        "event_id",
    ]
    rows = [
        [
            a.position,
            a.time,
            a.run_id,
            a.attempt,
            a.step,
            a.rule,
            a.metric,
            a.value,
            a.baseline,
            a.score,
            a.event_id,
        ]
        for a in found
    ]
    if fmt is None and output is None and not rows:
        err_console.print("no anomalies" + (" match" if run or rule else " recorded"), highlight=False)
        return
    print_rows(columns, rows, fmt, output, title="anomalies", limit=limit, full=full)


alerts_app.command("deliver")(deliver)
alerts_app.command("list")(list_anomalies)


if __name__ == "__main__":  # this group on its own, with the program's signal policy (exit 128 + N)
    from runledger import signals
    from runledger.cli.interrupts import InterruptibleGroup

    signals.install(starting=True)
    standalone = typer.Typer(add_completion=False, pretty_exceptions_enable=False, cls=InterruptibleGroup)
    standalone.add_typer(alerts_app, name="alerts")
    standalone()
