"""Values a user logs (Python numbers, NumPy or JAX arrays, torch tensors) as host numbers.

Torch is detected by type (its module name), never imported here: a process that logs only Python
or NumPy values never loads it. All the torch tensors of one call reach the host in one transfer
per device (stacked there, then one ``.tolist()``/``.cpu()``), not one per value.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from typing import Any

import numpy as np

_SURROGATE = re.compile("[\ud800-\udfff]")
MAX_DEPTH = 8  # nested dicts deeper than this are refused (hostile or accidental recursion)


def _is_torch(value: Any) -> bool:
    return type(value).__module__.startswith("torch") and hasattr(value, "detach")


def flatten(values: Mapping[str, Any], *, sep: str = "/") -> dict[str, Any]:
    """Nested mappings as one level (``{"eval": {"loss": 1}}`` → ``{"eval/loss": 1}``); raises
    ValueError past ``MAX_DEPTH`` levels."""
    out: dict[str, Any] = {}
    stack: list[tuple[str, Mapping[str, Any], int]] = [("", values, 0)]
    while stack:
        prefix, mapping, depth = stack.pop()
        if depth > MAX_DEPTH:
            raise ValueError(f"logged values nest deeper than {MAX_DEPTH} levels (at {prefix!r})")
        for key, value in mapping.items():
            text = key if type(key) is str and key.isascii() else _text(key)  # (the usual key, as is)
            name = f"{prefix}{sep}{text}" if prefix else text
            if type(value) not in _NOT_MAPPINGS and isinstance(value, Mapping):  # (an ABC check: ~1 µs)
                stack.append((name, value, depth + 1))
            else:
                out[name] = value
    return out


_NOT_MAPPINGS = frozenset({float, int, bool, str, type(None), np.float64, np.float32, np.int64, np.ndarray})


def _text(key: Any) -> str:
    """A key as text that encodes (a lone surrogate would fail the event's JSON encoding later)."""
    text = str(key)
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        text = _SURROGATE.sub("\ufffd", text)  # the replacement character, as a decoder would show
    return text


def scalars(values: Mapping[str, Any]) -> tuple[dict[str, float | int | None], list[str]]:
    """(name → host number, names skipped): numbers, bools (1.0/0.0), 0-d / one-element arrays and
    tensors are kept (None and non-finite → None); strings, media, multi-element arrays are
    skipped, by name."""
    out: dict[str, float | int | None] = {}
    skipped: list[str] = []
    tensors: dict[Any, list[tuple[str, Any]]] = {}  # device → (name, tensor)
    for name, value in values.items():
        if type(value) is float:  # the usual value first
            out[name] = value if math.isfinite(value) else None
        elif value is None:
            out[name] = None  # a value known to be missing (a NaN turned null upstream) stays null
        elif isinstance(value, bool):
            out[name] = float(value)  # W&B keeps bools; as numbers they stay queryable (1.0 / 0.0)
        elif isinstance(value, int):
            out[name] = int(value)  # a plain int (an IntEnum or int subclass would not encode)
        elif isinstance(value, float):  # np.float64 too: made a plain float, which always encodes
            out[name] = float(value) if math.isfinite(value) else None
        elif _is_torch(value):
            if value.numel() == 1:
                tensors.setdefault(value.device, []).append((name, value))
            else:
                skipped.append(name)
        elif isinstance(value, np.generic | np.ndarray) or hasattr(value, "__array__"):
            out_value = _array_scalar(value)
            if out_value is _SKIP:
                skipped.append(name)
            else:
                out[name] = out_value  # type: ignore[assignment]
        else:
            skipped.append(name)
    for items in tensors.values():
        out.update(_torch_scalars(items))
    return out, skipped


_SKIP = object()


def _array_scalar(value: Any) -> float | int | object | None:
    try:
        array = np.asarray(value)
    except Exception:
        return _SKIP
    if array.size != 1 or array.dtype.kind not in "biuf":
        return _SKIP
    item = array.reshape(()).item()
    if isinstance(item, bool):
        return float(item)
    if isinstance(item, float) and not math.isfinite(item):
        return None
    return item


def _torch_scalars(items: list[tuple[str, Any]]) -> dict[str, float | None]:
    """One device's scalar tensors: stacked on the device (one stack per dtype, then one cast and one
    concatenation), one transfer to the host. Few torch calls on purpose: each may release the GIL,
    and the emitter thread then runs in the middle of the caller's ``log``."""
    import torch  # the caller handed us tensors: torch is loaded already

    by_dtype: dict[Any, list[tuple[str, Any]]] = {}
    for name, tensor in items:
        by_dtype.setdefault(tensor.dtype, []).append((name, tensor))
    names: list[str] = []
    parts = []
    with torch.no_grad():
        for group in by_dtype.values():
            names += [name for name, _ in group]
            parts.append(torch.stack([t if t.dim() == 0 else t.reshape(()) for _, t in group]))
        stacked = parts[0] if len(parts) == 1 else torch.cat([p.to(torch.float64) for p in parts])
        host = stacked.to(torch.float64).tolist()
    return {name: (v if math.isfinite(v) else None) for name, v in zip(names, host, strict=True)}


def arrays(values: Mapping[str, Any]) -> dict[str, np.ndarray]:
    """Per-layer arrays (1-D) and matrices (2-D) as float64 NumPy arrays. The torch tensors among
    them are flattened and concatenated on their device and copied to the host once."""
    out: dict[str, np.ndarray] = {}
    tensors: list[tuple[str, Any]] = []
    for name, value in values.items():
        if value is None:
            continue
        if _is_torch(value):
            tensors.append((name, value))
            continue
        try:
            out[name] = np.asarray(value, dtype=np.float64)
        except (TypeError, ValueError) as exc:
            raise ValueError(f"{name} is not a numeric array: {exc}") from None
    if tensors:
        import torch

        with torch.no_grad():
            device = tensors[0][1].device
            flat = torch.cat(
                [t.detach().to(device=device, dtype=torch.float64).reshape(-1) for _, t in tensors]
            )
            host = flat.cpu().numpy()  # the one device-to-host copy
        offset = 0
        for name, t in tensors:
            n = t.numel()
            out[name] = host[offset : offset + n].reshape(tuple(t.shape))
            offset += n
    return out
