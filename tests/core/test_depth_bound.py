"""``too_deep`` on records over 4 KiB (``test_hostile_input`` draws short ones): the path that
scans a long record's structure agrees with the exact depth, with empty arrays, "[]" inside strings
and long narrow chains (issue 39: a router event, 48 layers of ``"expert_counts":[]``, is one)."""

from __future__ import annotations

import json

from hypothesis import given, settings
from hypothesis import strategies as st

from runledger.schemas.codec import MAX_DEPTH, nesting_depth, too_deep

_tricky_text = st.text(alphabet='[]{}"\\ab\n', max_size=8)
_json_values: st.SearchStrategy[object] = st.recursive(
    st.none() | st.integers() | _tricky_text | st.just([]),
    lambda inner: st.lists(inner, max_size=5) | st.dictionaries(_tricky_text, inner, max_size=4),
    max_leaves=60,
)


def _depth(value: object) -> int:
    if isinstance(value, dict):
        return 1 + max((_depth(v) for v in value.values()), default=0)
    if isinstance(value, list):
        return 1 + max((_depth(v) for v in value), default=0)
    return 0


def _long_record(value: object, wrap: int, empties: int) -> tuple[bytes, int]:
    """``value`` under ``wrap`` arrays, beside ``empties`` empty arrays and a padding string that
    holds "[]" in its text, in an object: over 4 KiB."""
    inner = b"[" * wrap + json.dumps(value).encode() + b"]" * wrap
    raw = (
        b'{"pad":"' + b"[]x" * 1400 + b'","empty":[' + b",".join([b"[]"] * empties) + b'],"v":' + inner + b"}"
    )
    depth = 1 + max(wrap + _depth(value), 2 if empties else 1)
    return raw, depth


@settings(max_examples=300, deadline=None)
@given(_json_values, st.integers(min_value=0, max_value=80), st.integers(min_value=0, max_value=120))
def test_the_bound_agrees_with_the_exact_depth(value: object, wrap: int, empties: int) -> None:
    raw, depth = _long_record(value, wrap, empties)
    assert len(raw) > 4096
    assert nesting_depth(raw) == depth
    for limit in (3, depth - 1, depth, MAX_DEPTH):
        if limit >= 1:
            assert too_deep(raw, limit=limit) == (depth > limit)


def test_a_router_event_shape_is_shallow() -> None:
    layers = [{"layer": i, "expert_counts": [], "drop": 0.1} for i in range(48)]
    raw = json.dumps({"data": {"layers": layers}, "pad": "x" * 4096}).encode()
    assert not too_deep(raw)
    deep = json.dumps({"data": {"layers": layers}, "pad": "x" * 4096, "v": [[[[]]]] * 1}).encode()
    assert not too_deep(deep) and too_deep(deep, limit=4) == (nesting_depth(deep) > 4)
