"""The name of every `ledger` command and group, once: the app is built from these lists
(``runledger.cli.main``), and the console script reads a command's name from its arguments with them
(``runledger.cli.entry``) before anything heavier than the standard library is imported."""

from __future__ import annotations

from collections.abc import Sequence

# Each command's words and its function ("module:function" in runledger.cli), in listing order.
COMMANDS: tuple[tuple[str, str], ...] = (
    # Reading the ledger.
    ("query", "ledger_cmd:query"),
    ("runs", "ledger_cmd:runs"),
    ("history", "ledger_cmd:history"),
    ("state", "ledger_cmd:state"),
    ("diff", "ledger_cmd:diff"),
    ("blame", "ledger_cmd:blame"),
    ("compact", "ledger_cmd:compact"),
    ("views", "ledger_cmd:views"),
    ("shell", "shell_cmd:shell"),
    ("report", "report_cmd:report"),
    ("plot", "report_cmd:plot"),
    # Producing and rebuilding.
    ("init", "init_cmd:init"),
    ("train", "train_cmd:train"),
    ("edit", "train_cmd:edit"),
    ("simulate", "simulate_cmd:simulate"),
    ("replay", "kafka_cmd:replay"),
    # Tamper evidence (a "checkpoint" here is a signed log checkpoint, not a model checkpoint).
    ("checkpoint", "merkle_cmd:checkpoint"),
    ("verify", "merkle_cmd:verify"),
    ("verify-proof", "merkle_cmd:verify_proof"),
    ("publish", "publish_cmd:publish"),
    ("redact", "redact_cmd:redact"),
    ("monitor", "publish_cmd:monitor"),
    ("demo", "demo_cmd:demo"),
    ("migrate", "migrate_cmd:migrate"),
    # Groups' commands.
    ("ingest spool", "ingest_cmd:ingest_spool"),
    ("ingest kafka", "ingest_cmd:ingest_kafka"),
    ("ingest github", "ingest_cmd:ingest_github"),
    ("ingest wandb", "ingest_cmd:ingest_wandb"),
    ("schemas export", "schemas_cmd:export_schemas"),
    ("schemas list", "schemas_cmd:list_schemas"),
    ("serve webhooks", "serve_cmd:serve_webhooks"),
    ("serve page", "page_cmd:serve_page"),
    ("kafka drain-spool", "kafka_cmd:drain_spool"),
    ("kafka topic create", "kafka_cmd:topic_create"),
    ("kafka topic describe", "kafka_cmd:topic_describe"),
    ("kafka topic add-partitions", "kafka_cmd:topic_add_partitions"),
    ("s3 bucket create", "s3_cmd:bucket_create"),
    ("keys init", "merkle_cmd:keys_init"),
    ("producers add", "producers_cmd:add"),
    ("producers rotate", "producers_cmd:rotate"),
    ("producers revoke", "producers_cmd:revoke"),
    ("producers list", "producers_cmd:list_producers"),
    ("producers policy", "producers_cmd:policy"),
    ("producers export", "producers_cmd:export"),
    ("study token-drop", "study_cmd:token_drop"),
    ("witness add", "publish_cmd:witness_add"),
    ("witness quorum", "publish_cmd:witness_quorum"),
    ("witness list", "publish_cmd:witness_list"),
    ("prove inclusion", "merkle_cmd:prove_inclusion"),
    ("prove consistency", "merkle_cmd:prove_consistency"),
    ("alerts deliver", "alerts_cmd:deliver"),
    ("alerts list", "alerts_cmd:list_anomalies"),
)
# Each group's words and its help, in listing order; "module:attribute" for a group whose command
# module makes its typer app itself.
GROUPS: tuple[tuple[str, str], ...] = (
    ("ingest", "Fold events from a bus or an outside system into the ledger."),
    ("schemas", "The event catalogue."),
    ("serve", "Long-running receivers."),
    ("kafka", "Kafka bus utilities."),
    ("kafka topic", "Kafka topics: create with N partitions, describe, add partitions."),
    ("s3", "S3 buckets for lakes and published copies."),
    ("s3 bucket", "S3 buckets."),
    ("keys", "The Ed25519 key pair that signs log checkpoints."),
    ("producers", "Producer keys and what each may write (kept as events in the log)."),
    ("study", "study_cmd:study_app"),
    ("witness", "publish_cmd:witness_app"),
    ("prove", "Proofs anyone can check with `python -m runledger.ledger.verifier`."),
    ("alerts", "alerts_cmd:alerts_app"),
)
MADE_BY_MODULE = frozenset({"study", "witness", "alerts"})  # GROUPS whose entry names a typer app


# The command groups (`ledger ingest spool`): their commands are named by two words, the others by one.
GROUP_NAMES = frozenset(words for words, _ in GROUPS if " " not in words)


def command_words(args: Sequence[str]) -> list[str]:
    """The command's name as words (``ingest wandb``, ``query``): options and arguments left out."""
    words: list[str] = []
    for arg in args:
        if arg.startswith("-"):
            if words:
                break
            continue  # a top-level flag (--help, --version): none of them takes a value
        words.append(arg)
        if words[0] not in GROUP_NAMES or len(words) == 2:
            break
    return words
