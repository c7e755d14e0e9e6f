"""`ledger s3 bucket create`: the bucket a lake (`ledger init --data s3://…`) or a published copy
(`ledger publish s3://…`) goes in, made on purpose (neither makes one: a typo would become a bucket).
The server and credentials are the AWS_* variables every S3 command here reads."""

from __future__ import annotations

from typing import Annotated

import typer

from runledger.cli.output import console, fail


def bucket_create(
    url: Annotated[str, typer.Argument(help="s3://BUCKET (a /prefix after it is allowed and ignored).")],
) -> None:
    """Create an S3 bucket on the server AWS_ENDPOINT_URL names (AWS itself when unset), with
    AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY / AWS_REGION. A bucket already there: said, exit 0.

    Example: AWS_ENDPOINT_URL=http://127.0.0.1:7070 ledger s3 bucket create s3://runs
    """
    from runledger.ledger.publish_dest import DestError, S3Config, create_bucket, parse_s3_url

    try:
        bucket, _ = parse_s3_url(url)
        config = S3Config.from_env()
        made = create_bucket(url, config)
    except DestError as exc:
        raise fail(str(exc)) from None
    where = config.endpoint or "AWS S3"
    console.print(f"bucket s3://{bucket} {'created' if made else 'exists'} at {where}", highlight=False)
