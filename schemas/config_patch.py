"""Applying a live config change: an RFC 6902 JSON Patch onto a resolved config.

One definition for every writer and reader of ``runledger.config.changed`` events (the client and
the simulator that apply a live change, the ledger's table projection, fold and history); each
decides for itself what a patch that does not apply means. Part of the catalogue: it depends on
nothing of the ledger.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import jsonpatch
import jsonpointer
import msgspec


class ConfigPatchError(ValueError):
    """A patch that does not apply to the config (a failed ``test``, a missing path, a bad op)."""


def apply_config_patch(config: dict[str, Any], patch: Iterable[Any]) -> dict[str, Any]:
    """The config with ``patch`` applied; ``config`` itself is left unchanged.

    ``patch`` is a sequence of operations, as dicts or as the event's msgspec Structs.
    Raises ``ConfigPatchError`` (chained to jsonpatch's error) when the patch does not apply.
    """
    ops = msgspec.to_builtins(list(patch))
    try:
        new: dict[str, Any] = jsonpatch.apply_patch(config, ops)
    except (jsonpatch.JsonPatchException, jsonpointer.JsonPointerException) as exc:
        raise ConfigPatchError(f"config patch does not apply: {exc}") from exc
    return new
