"""Benchmark producer signatures: ledger ingest with signature verification on vs off, in one run.

Run from the repository root::

    .venv/bin/python -m bench.bench_signatures [--events 20000] [--batch 2000] [--repeat 3]

The same realistic step-metrics events (noisy floats, 8 free-form scalars) are committed to fresh
ledgers with ``Ledger.commit`` in batches (what the spool and Kafka ingesters call), three ways:

* off: unsigned events, no registry (admission is off: the behaviour before producer identity);
* signed, unverified: the events signed and chained by a ``Sealer``, no registry (the chain is
  checked, signatures are carried but not verified);
* on: the same signed events, the producer registered (every signature verified, scope checked).

Printed: events/s of each (best of ``--repeat``), the cost per event against "off", and, apart, the
Ed25519 verification alone (``verify_canonical``), the bare ``cryptography`` call it makes (the same
signatures: what is left once every Python-side cost is gone) and the producer's sealing, per event.
"""

from __future__ import annotations

import argparse
import random
import shutil
import tempfile
import time
from pathlib import Path

from runledger.ledger.registry import register_producer
from runledger.ledger.store import Ledger, SourceRecord
from runledger.ledger.verifier import producer_signing_bytes
from runledger.schemas import Event, decode_event, encode_event, make_event
from runledger.schemas.note import parse_public_key, write_keypair
from runledger.schemas.payloads import ProducerScope, StepMetrics
from runledger.schemas.signing import Sealer, verify_canonical

SOURCE = "trainer/bench/a1/rank0"


def events(n: int) -> list:
    rng = random.Random(7)
    return [
        make_event(
            StepMetrics(
                loss=rng.uniform(1, 5),
                grad_norm=rng.uniform(0, 2),
                lr=3e-4 * rng.random(),
                tokens=4096,
                tokens_per_second=rng.uniform(1e4, 1e5),
                step_time_s=rng.uniform(0.1, 1),
                scalars={f"s{k}": rng.gauss(0, 1) for k in range(8)},
            ),
            source=SOURCE,
            stream="bench",
            run_id="bench",
            attempt=1,
            step=i,
            seq=i,
        )
        for i in range(n)
    ]


def ingest(root: Path, raws: list[bytes], batch: int, public_key: str | None) -> float:
    """Seconds to commit every record to a fresh ledger (registering ``public_key`` first if given)."""
    ledger = Ledger.create(root)
    if public_key is not None:
        register_producer(ledger, "bench", public_key, ProducerScope(sources=["trainer/"]))
    t = time.perf_counter()
    for start in range(0, len(raws), batch):
        records = [
            SourceRecord("spool:bench", i, raws[i]) for i in range(start, min(start + batch, len(raws)))
        ]
        result = ledger.commit(records)
        assert not result.quarantined, result.quarantined[0][1].reason
    elapsed = time.perf_counter() - t
    shutil.rmtree(root)
    return elapsed


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--events", type=int, default=20000)
    ap.add_argument("--batch", type=int, default=2000)
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="bench-signatures-"))
    try:
        private, public = write_keypair(work / "keys", "bench")
        public_key = public.read_text().strip()
        plain = events(args.events)
        sealer = Sealer(private.read_text())
        t = time.perf_counter()
        sealed = [sealer.seal(e) for e in plain]
        seal_us = (time.perf_counter() - t) / len(plain) * 1e6
        unsigned_raws = [encode_event(e) for e in plain]
        signed_raws = [encode_event(e) for e in sealed]
        canonicals = []
        for raw in signed_raws:
            event = decode_event(raw)
            assert isinstance(event, Event)
            canonicals.append(event.canonical)
        verifier = parse_public_key(public_key)
        t = time.perf_counter()
        for canonical in canonicals:
            verify_canonical(canonical, verifier)
        verify_us = (time.perf_counter() - t) / len(canonicals) * 1e6
        # The floor: OpenSSL's Ed25519 check on bytes prepared beforehand (no decode, no key lookup).
        prepared = [producer_signing_bytes(canonical) for canonical in canonicals]
        t = time.perf_counter()
        for message, _, signature in prepared:
            verifier.public_key.verify(signature, message)
        bare_us = (time.perf_counter() - t) / len(prepared) * 1e6

        cases = {
            "off (unsigned, no registry)": (unsigned_raws, None),
            "signed, unverified (chain only)": (signed_raws, None),
            "on (signed, verified)": (signed_raws, public_key),
        }
        best: dict[str, float] = {}
        for r in range(args.repeat):
            for name, (raws, key) in cases.items():  # interleaved: drift hits every case alike
                seconds = ingest(work / f"l-{r}-{len(best)}", raws, args.batch, key)
                best[name] = min(best.get(name, seconds), seconds)
        n = args.events
        base = best["off (unsigned, no registry)"]
        print(f"ingest of {n} step-metrics events, batches of {args.batch}, best of {args.repeat}:")
        for name, seconds in best.items():
            extra = (seconds - base) / n * 1e6
            print(
                f"  {name:34s} {n / seconds:9.0f} events/s   {seconds / n * 1e6:7.1f} us/event   {extra:+6.1f} us vs off"
            )
        print(f"  Ed25519 verification alone (verify_canonical): {verify_us:6.1f} us/event")
        print(f"  bare Ed25519 verify (cryptography, baseline):   {bare_us:6.1f} us/event")
        print(f"  producer sealing (sign + chain hash):          {seal_us:6.1f} us/event")
        print(f"  verification / commit cost per event (off):    {verify_us / (base / n * 1e6):6.1%}")
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
