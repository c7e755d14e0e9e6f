"""Witnesses of the published log (C2SP tlog-witness, tlog-cosignature): who they are, how many
must cosign (the quorum), and asking them.

The witnesses of a ledger and its quorum are kept in ``<ledger>/_publish/witnesses.json`` (``ledger
witness add NAME URL VKEY``, ``ledger witness quorum N``). Before a publish swaps in a new
checkpoint, it POSTs ``<URL>/add-checkpoint`` to each witness: ``old <size>``, the consistency proof
from that size (base64 hashes, one a line), a blank line, the signed checkpoint. Answers:

* 200: cosignature lines, each checked here against the witness's vkey before it is kept;
* 409: the witness is at another size (``text/x.tlog.size``): asked once more, from that size;
* 422: the witness has seen a *different history* of this log: ``WitnessRefused``, loudly, and the
  publish stops (a fork or a rewrite, never to be published);
* anything else (403 unknown key, 404 unknown log, unreachable): that witness does not count.

Fewer valid cosignatures than the quorum and nothing is published. Ed25519 cosignature/v1 keys are
``name+hash+base64(0x04 ‖ key)``; a signature is ``key hash ‖ 8-byte big-endian time ‖ 64-byte
Ed25519 signature`` over ``cosignature/v1\\ntime <t>\\n`` + the checkpoint body.
"""

from __future__ import annotations

import base64
import hashlib
import json
import re
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

from runledger.schemas.durable import write_durably
from runledger.schemas.note import CheckpointError, decode_canonical_base64

__all__ = [
    "CosignatureKey",
    "Witness",
    "WitnessPolicy",
    "WitnessRefused",
    "add_witness",
    "collect_cosignatures",
    "load_policy",
    "parse_cosignature_key",
    "set_quorum",
    "verify_cosignatures",
]

ALG_COSIGNATURE_V1 = 0x04
POLICY_FILE = Path("_publish") / "witnesses.json"
_TIMEOUT_S = 10
_SIG_PREFIX = "— "


class WitnessRefused(ValueError):
    """A witness answered 422: it has seen another history of this log."""


@dataclass(frozen=True)
class CosignatureKey:
    name: str
    key_hash: int
    public_key: Ed25519PublicKey


@dataclass(frozen=True)
class Witness:
    name: str  # ours, for reports
    url: str
    vkey: str


@dataclass
class WitnessPolicy:
    witnesses: list[Witness] = field(default_factory=list)
    quorum: int = 0


def _key_hash(name: str, key: bytes) -> int:
    return int.from_bytes(
        hashlib.sha256(name.encode() + b"\n" + bytes([ALG_COSIGNATURE_V1]) + key).digest()[:4], "big"
    )


def parse_cosignature_key(vkey: str) -> CosignatureKey:
    """A witness's Ed25519 cosignature/v1 vkey; CheckpointError unless well formed."""
    parts = vkey.strip().split("+", 2)
    if len(parts) != 3 or not re.fullmatch(r"[0-9a-f]{8}", parts[1]) or not parts[0] or " " in parts[0]:
        raise CheckpointError("malformed witness key: want <name>+<8 hex>+<base64(0x04 ‖ key)>")
    name, hash_hex, blob = parts
    raw = decode_canonical_base64(blob, "witness key")
    if len(raw) != 33 or raw[0] != ALG_COSIGNATURE_V1:
        raise CheckpointError("witness key is not an Ed25519 cosignature/v1 key (0x04 ‖ 32 bytes)")
    if _key_hash(name, raw[1:]) != int(hash_hex, 16):
        raise CheckpointError("witness key hash does not match its name and key")
    return CosignatureKey(name, int(hash_hex, 16), Ed25519PublicKey.from_public_bytes(raw[1:]))


def _body_of(checkpoint: str) -> str:
    return checkpoint[: checkpoint.rfind("\n\n") + 1]


def verify_cosignatures(checkpoint: str, keys: Sequence[CosignatureKey]) -> list[str]:
    """The names of the keys whose valid cosignature is on ``checkpoint`` (a signed note)."""
    body = _body_of(checkpoint)
    good: list[str] = []
    for line in checkpoint[len(body) + 1 :].splitlines():
        name, _, blob = line.removeprefix(_SIG_PREFIX).partition(" ")
        try:
            raw = base64.b64decode(blob, validate=True)
        except ValueError:
            continue
        for key in keys:
            if name != key.name or len(raw) != 4 + 8 + 64 or int.from_bytes(raw[:4], "big") != key.key_hash:
                continue
            when = int.from_bytes(raw[4:12], "big")
            try:
                key.public_key.verify(raw[12:], f"cosignature/v1\ntime {when}\n{body}".encode())
            except InvalidSignature:
                continue
            if key.name not in good:
                good.append(key.name)
    return good


# ------------------------------------------------------------------------------------ policy on disk


def load_policy(root: Path) -> WitnessPolicy:
    path = root / POLICY_FILE
    if not path.exists():
        return WitnessPolicy()
    doc = json.loads(path.read_bytes())
    return WitnessPolicy([Witness(**w) for w in doc["witnesses"]], doc["quorum"])


def _save_policy(root: Path, policy: WitnessPolicy) -> None:
    (root / POLICY_FILE).parent.mkdir(parents=True, exist_ok=True)
    doc = {"witnesses": [w.__dict__ for w in policy.witnesses], "quorum": policy.quorum}
    write_durably(root / POLICY_FILE, json.dumps(doc, indent=1))


def add_witness(root: Path, name: str, url: str, vkey: str) -> WitnessPolicy:
    """Add a witness; the quorum becomes all witnesses unless one was set (``set_quorum``)."""
    parse_cosignature_key(vkey)
    if not re.fullmatch(r"https?://[^\s]+", url):
        raise ValueError(f"witness URL {url!r} must be http:// or https://")
    policy = load_policy(root)
    if any(w.name == name for w in policy.witnesses):
        raise ValueError(f"a witness named {name!r} is already configured")
    all_of_them = policy.quorum == len(policy.witnesses)
    policy.witnesses.append(Witness(name, url.rstrip("/") + "/", vkey.strip()))
    if all_of_them:
        policy.quorum = len(policy.witnesses)
    _save_policy(root, policy)
    return policy


def set_quorum(root: Path, quorum: int) -> WitnessPolicy:
    policy = load_policy(root)
    if not 0 <= quorum <= len(policy.witnesses):
        raise ValueError(f"quorum {quorum} is not between 0 and the {len(policy.witnesses)} witnesses")
    policy.quorum = quorum
    _save_policy(root, policy)
    return policy


# ------------------------------------------------------------------------------------ asking


def _post(url: str, body: bytes) -> tuple[int, bytes]:
    request = urllib.request.Request(url, data=body, method="POST")
    try:
        with urllib.request.urlopen(request, timeout=_TIMEOUT_S) as response:
            return response.status, response.read(1 << 16)
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read(1 << 16)


def _ask(witness: Witness, checkpoint: str, old_size: int, proof: Sequence[bytes]) -> tuple[int, bytes]:
    lines = [f"old {old_size}", *(base64.b64encode(h).decode() for h in proof)]
    body = "\n".join(lines) + "\n\n" + checkpoint
    return _post(witness.url + "add-checkpoint", body.encode())


def _cosign_one(
    witness: Witness, checkpoint: str, old_size: int, new_size: int, prove: Callable[[int], list[bytes]]
) -> tuple[list[str], int | None, str]:
    """(cosignature lines, the size the witness is now at, what happened) for one witness."""
    for _ in range(2):  # once from the size we believe it is at, once more from the size it names
        try:
            status, answer = _ask(witness, checkpoint, old_size, prove(old_size))
        except OSError as exc:
            return [], None, f"unreachable ({exc})"
        if status == 409:
            text = answer.decode(errors="replace").strip()
            if not text.isdigit() or int(text) > new_size:
                return [], None, f"409, at size {text!r}, beyond this checkpoint"
            old_size = int(text)
            continue
        if status == 422:
            raise WitnessRefused(
                f"witness {witness.name} ({witness.url}) answered 422: it has seen a different history of "
                f"this log than the checkpoint of size {new_size}; nothing was published"
            )
        if status != 200:
            return [], None, f"HTTP {status}: {answer.decode(errors='replace').strip()[:200]}"
        lines = [
            line for line in answer.decode(errors="replace").splitlines() if line.startswith(_SIG_PREFIX)
        ]
        cosigned = checkpoint + "".join(line + "\n" for line in lines)
        if not verify_cosignatures(cosigned, [parse_cosignature_key(witness.vkey)]):
            return [], None, "200, but no valid cosignature by its key"
        return lines, new_size, "cosigned"
    return [], None, "409 twice"


def collect_cosignatures(
    policy: WitnessPolicy,
    checkpoint: str,
    new_size: int,
    sizes: dict[str, int],
    prove: Callable[[int], list[bytes]],
) -> tuple[str, dict[str, str]]:
    """``checkpoint`` with the cosignatures of the policy's witnesses appended, and what each witness
    did. ``sizes``: the size each witness was last at (updated). Raises WitnessRefused on a 422, and
    ValueError when fewer than the quorum cosigned."""
    lines: list[str] = []
    outcome: dict[str, str] = {}
    for witness in policy.witnesses:
        got, size, what = _cosign_one(witness, checkpoint, sizes.get(witness.name, 0), new_size, prove)
        lines += got
        outcome[witness.name] = what
        if size is not None:
            sizes[witness.name] = size
    cosigned = sum(1 for what in outcome.values() if what == "cosigned")
    if cosigned < policy.quorum:
        detail = "; ".join(f"{name}: {what}" for name, what in outcome.items())
        raise ValueError(f"only {cosigned} of the quorum of {policy.quorum} witnesses cosigned ({detail})")
    return checkpoint + "".join(line + "\n" for line in lines), outcome
