"""The canonical bytes (and so the Merkle root) of a fixed set of client-built events never change.

The events are built the way the client builds them (``host_values``, ``metrics_from_values``,
``Run.log_router``'s ``_router_columns``/``_router_payload``, ``make_event`` with fixed ids and
times), sent through the bus encoding and decoded at the ledger's door. The digests below were
computed by the code as it was before issue 39 reworked the client's payload builders: a change that
alters one byte of any event's canonical form fails here."""

from __future__ import annotations

import hashlib
import math
from datetime import UTC, datetime, timedelta

import numpy as np

from runledger import host_values
from runledger.client import _router_columns, _router_payload
from runledger.ledger.merkle import leaf_hash, root_from_leaf_hashes
from runledger.schemas.codec import Event, decode_event, encode_event, make_event
from runledger.schemas.step_payloads import metrics_from_values

LAYERS, EXPERTS = 6, 8
START = datetime(2026, 12, 6, 12, 0, 0, 123456, tzinfo=UTC)
EXPECTED_ROOT = "3029865d2f1a7a785f0fd73697a35218a18c7b1e01b648e353d2772ddc74e72d"
EXPECTED_CANONICAL_SHA256 = "700418cae5c4e799c7a20c43251525e1c5e576bb8b1bbecf67250f0bd2b58b4a"


def _router_arrays(step: int) -> dict[str, np.ndarray]:
    """Per-layer values with NaN and infinities among them (they travel as null)."""
    rng = np.random.default_rng(step)
    counts = rng.integers(0, 500, size=(LAYERS, EXPERTS))
    entropy = rng.uniform(0.5, 2.0, LAYERS)
    entropy[step % LAYERS] = math.nan
    aux = rng.uniform(0.0, 0.1, LAYERS)
    aux[(step + 1) % LAYERS] = math.inf
    drop = rng.uniform(0.0, 0.2, LAYERS)
    return {
        "counts": counts,
        "drop": drop,
        "aux_loss": aux,
        "entropy": entropy,
        "max_load": rng.uniform(1.0, 3.0, LAYERS),
    }


def fixed_events() -> list[Event]:
    """Twenty steps: a step.metrics and a moe.router_stats event each, every id and time fixed."""
    events = []
    for step in range(1, 21):
        when = START + timedelta(milliseconds=37 * step)
        values = {
            "loss": 10.0 / step,
            "lr": 3e-4,
            "tokens": 4096,
            "total_tokens": 4096.0 * step,  # a whole float in a count field: stored as an int
            "mfu": math.nan,
            "eval/ppl": 1.5 + step,
            "grad/overflow": math.inf,  # a named scalar that is not finite: null
            "train/learning_rate": 1e-4,  # an alias of lr, which the row has: kept as a named scalar
            "is_best": step % 7 == 0,
            "router/max_load/L00": np.float32(1.25) * step,
        }
        arrays = host_values.arrays(_router_arrays(step))  # as ``Run.log_router`` takes them
        router = _router_payload(_router_columns(arrays, LAYERS, 2), arrays, 2)
        payloads = [metrics_from_values(host_values.scalars(values)[0]), router]
        for k, payload in enumerate(payloads):
            envelope = make_event(
                payload,
                source="trainer/golden/a1/rank0",
                stream="golden",
                run_id="golden",
                attempt=1,
                step=step,
                seq=2 * step + k,
                id=f"golden-{step}-{k}",
                time=when,
            )
            decoded = decode_event(encode_event(envelope))
            assert isinstance(decoded, Event), decoded
            events.append(decoded)
    return events


def test_canonical_bytes_of_fixed_events_are_unchanged() -> None:
    events = fixed_events()
    digest = hashlib.sha256(b"\n".join(e.canonical for e in events)).hexdigest()
    root = root_from_leaf_hashes([leaf_hash(e.canonical) for e in events]).hex()
    assert (digest, root) == (EXPECTED_CANONICAL_SHA256, EXPECTED_ROOT)


def test_non_finite_values_travel_as_null() -> None:
    router = fixed_events()[1].canonical
    assert b"NaN" not in router and b"Infinity" not in router
    assert b'"routing_entropy":null' in router and b'"aux_loss":null' in router
