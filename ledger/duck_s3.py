"""DuckDB's S3 secret from the AWS_* variables: one function for every connection that reads S3.

``ledger query --remote s3://… --direct`` (``runledger.ledger.remote``) and a lake whose data path is
``s3://bucket/prefix`` (``runledger.ledger.lake``) both reach the server that ``runledger.ledger.publish_dest.S3Config``
describes (``AWS_ENDPOINT_URL``, ``AWS_ACCESS_KEY_ID``, ``AWS_SECRET_ACCESS_KEY``,
``AWS_SESSION_TOKEN``, ``AWS_REGION`` / ``AWS_DEFAULT_REGION``), with path-style addressing (what
S3-compatible servers answer). The connection must have ``httpfs`` loaded.
"""

from __future__ import annotations

from urllib.parse import urlsplit

import duckdb

from runledger.ledger.publish_dest import S3Config

__all__ = ["create_s3_secret", "s3_secret_options"]


def s3_secret_options(config: S3Config) -> dict[str, str]:
    """The secret's options (REGION, URL_STYLE, ENDPOINT, USE_SSL, KEY_ID, SECRET, SESSION_TOKEN)."""
    options = {"REGION": config.region, "URL_STYLE": "path"}
    if config.endpoint:
        parts = urlsplit(config.endpoint)
        options |= {"ENDPOINT": parts.netloc, "USE_SSL": str(parts.scheme == "https").lower()}
    if config.access_key:
        options |= {"KEY_ID": config.access_key, "SECRET": config.secret_key}
        if config.session_token:
            options["SESSION_TOKEN"] = config.session_token
    return options


def create_s3_secret(con: duckdb.DuckDBPyConnection, config: S3Config, name: str = "runledger_s3") -> None:
    """``CREATE SECRET name (TYPE s3, …)`` on ``con`` for the server and credentials of ``config``."""
    quoted = ", ".join(
        f"{k} {v}" if k == "USE_SSL" else f"{k} '{v.replace(chr(39), chr(39) * 2)}'"
        for k, v in s3_secret_options(config).items()
    )
    con.execute(f"CREATE SECRET {name} (TYPE s3, {quoted})")
