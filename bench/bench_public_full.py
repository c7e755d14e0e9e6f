"""Issue 27's figures at any size, up to the full reference run: `ledger publish`, remote verify, a
remote inclusion proof, each beside a baseline measured in the same run.

The ledger is the reference run (``ledger simulate reference-535b``) ingested from a spool **but its
last 1,000 steps**: ``prefix_spool`` makes a spool that is an exact prefix of the full one (same
spool id, segments hard-linked, the segment of the cut truncated at a record boundary), so that
ingesting the full spool afterwards adds exactly the next 1,000 steps — the run continuing. With
``--ledger PATH --spool PATH`` (a ledger ingested from ``prefix_spool(SPOOL)``, e.g. the one
``build`` makes) the benchmark works on a copy of PATH and never changes it; without them it builds
a small one (``--steps``, 10% of the run by default).

Figures (each command is a subprocess; peak RSS from GNU time or VmHWM, ``bench.measure``):

* ``ledger publish`` from scratch: time, peak RSS, bytes written to DEST; baseline: copying the same
  Parquet files (``shutil.copy2``, one by one);
* ``ledger publish`` after the next 1,000 steps were ingested; baseline: the same publish with nothing
  new;
* remote verify (``runledger.ledger.remote.verify_remote``, the check ``ledger verify --remote`` runs) from a
  local HTTP server: from scratch and after the 1,000 steps (time, peak RSS, bytes fetched);
  baseline: local ``ledger verify`` of the same ledger (``--local-verify``; minutes at full size);
* entry bundle and tile bytes per event (and per entry);
* one inclusion proof fetched and checked remotely: the checkpoint, the entry's bundle and the
  tiles of its audit path fetched over HTTP and checked (time, bytes); baseline: the same entry's
  offline tlog-proof (``ledger prove inclusion --format tlog-proof``) checked with nothing fetched.

    python -m bench.bench_public_full                        # builds 10% of the run (~3 min ingest)
    python -m bench.bench_public_full --steps 4000           # a quick debugging run
    python -m bench.bench_public_full build --workdir /tmp/ref      # the full run: spool, ledger, base
    python -m bench.bench_public_full --ledger /tmp/ref/base --spool /tmp/ref/spool --workdir /tmp/ref
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from bench.measure import Measured, run_measured
from runledger.ingest.spool import HIGH_WATER_FILE, SpoolReader
from runledger.schemas.codec import Event, decode_event

LEDGER_CLI = [sys.executable, "-m", "runledger.cli.main"]
TAIL_STEPS = 1000
# An address-space cap on every child (``--cap-mb``): a publish that holds the whole log in memory
# must fail alone, not take the shared machine's memory from everyone else.
CAP: list[str] = []
_WINDOW = 20_000  # spool records read back from the end to find the cut (1,000 steps: ~2,850)


# --- a spool that ends 1,000 steps early ----------------------------------------------------------


def _step_of(payload: bytes, run_id: str) -> int | None:
    decoded = decode_event(payload)
    if not isinstance(decoded, Event) or decoded.envelope.run_id != run_id:
        return None
    return decoded.envelope.step


def find_cut(spool: Path, run_id: str, last_steps: int = TAIL_STEPS) -> tuple[int, int, int]:
    """(cut, high_water, cut_step): the first position after the run's last record below step
    ``max step - last_steps + 1``. Records from ``cut`` on are the run's last ``last_steps`` steps
    (and whatever else, GitHub activity, came in meanwhile)."""
    reader = SpoolReader(spool)
    end = reader.high_water()
    window = _WINDOW
    while True:
        start = max(0, end - window)
        steps = [(r.index, _step_of(r.payload, run_id)) for r in reader.read(start) if r.corrupt is None]
        known = [(i, s) for i, s in steps if s is not None]
        if not known:
            raise SystemExit(f"error: no record of run {run_id} in the last {window} of {spool}")
        cut_step = max(s for _, s in known) - last_steps + 1
        below = [i for i, s in known if s < cut_step]
        if below or start == 0:
            return (max(below) + 1 if below else 0), end, cut_step
        window *= 4


def prefix_spool(spool: Path, out: Path, cut: int) -> None:
    """A spool holding positions ``0 .. cut-1`` of ``spool``, under the same spool id (so the ledger's
    position for it carries over): full segments hard-linked (readers never write them), the segment
    holding ``cut`` copied up to that record's offset."""
    reader = SpoolReader(spool)
    first = next(reader.read(cut, limit=1), None)
    if first is None:
        raise SystemExit(f"error: {spool} has no record at position {cut}")
    out.mkdir(parents=True)
    shutil.copy2(spool / "spool.id", out / "spool.id")
    for seg in sorted(spool.glob("*.seg")):
        base = int(seg.stem)
        if base < first.segment:
            os.link(seg, out / seg.name)
        elif base == first.segment and first.offset > 8:  # more than the segment's magic
            with seg.open("rb") as src, (out / seg.name).open("wb") as dst:
                dst.write(src.read(first.offset))
    (out / HIGH_WATER_FILE).write_text(f"{cut}\n")


# --- running and measuring ------------------------------------------------------------------------


def cli(args: list[str], log: Path) -> Measured:
    """One `ledger` command as its own process: wall time, CPU time, its own peak RSS (GNU time)."""
    proc = run_measured([*CAP, *LEDGER_CLI, *args], stderr=log)
    if proc.returncode != 0:
        lines = log.read_text(errors="replace").strip().splitlines() if log.exists() else []
        why = (proc.stdout.strip().splitlines() or lines or ["(no output)"])[-1]
        raise RuntimeError(f"ledger {' '.join(args)} exited {proc.returncode}: {why} (traceback in {log})")
    return proc


def tree_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


# --- the ledger: the run but its last 1,000 steps, and the full spool to continue it ---------------


@dataclass
class Built:
    spool: Path  # the whole run
    base: Path  # a ledger of the run but its last TAIL_STEPS steps
    figures: dict[str, str]


def build(work: Path, steps: int, log: Path, full_ledger: Path | None = None) -> Built:
    """Simulate ``steps`` steps into ``work/spool`` (unless it is there), ingest all but the last
    1,000 steps into ``work/base``. With ``full_ledger``: also the whole run there (a copy of base,
    then the rest of the spool), as one full-size ledger for others to read."""
    from runledger.workflows.simulate import RUN_ID

    spool, prefix, base = work / "spool", work / "spool-prefix", work / "base"
    figures: dict[str, str] = {}
    if not (spool / HIGH_WATER_FILE).exists():
        emit = cli(["simulate", "reference-535b", "--steps", str(steps), "--spool", str(spool)], log)
        figures["emit s"] = f"{emit.seconds:.1f}"
    cut, end, cut_step = find_cut(spool, RUN_ID)
    figures |= {"spool records": f"{end:,}", "cut at record": f"{cut:,}", "cut at step": f"{cut_step:,}"}
    shutil.rmtree(prefix, ignore_errors=True)
    prefix_spool(spool, prefix, cut)
    ingest = cli(["ingest", "spool", "--spool", str(prefix), "--ledger", str(base)], log)
    figures |= {"ingest s": f"{ingest.seconds:.1f}", "ingest peak RSS MB": f"{ingest.peak_rss_mb:.0f}"}
    shutil.rmtree(prefix)
    if full_ledger is not None:
        copy_s = _copy_tree(base, full_ledger)
        rest = cli(["ingest", "spool", "--spool", str(spool), "--ledger", str(full_ledger)], log)
        figures |= {"copy base s": f"{copy_s:.1f}", "ingest of the last 1,000 steps s": f"{rest.seconds:.1f}"}
    print(json.dumps(figures), flush=True)
    return Built(spool, base, figures)


def _copy_tree(src: Path, dst: Path) -> float:
    started = time.perf_counter()
    subprocess.run(["cp", "-a", str(src), str(dst)], check=True)
    return time.perf_counter() - started


# --- publishing -----------------------------------------------------------------------------------


def _files(folder: Path) -> dict[str, tuple[int, int, int]]:
    """Every file under ``folder``: (bytes, mtime ns, inode), to tell what a command wrote."""
    out = {}
    for path in folder.rglob("*"):
        if path.is_file():
            st = path.stat()
            out[str(path.relative_to(folder))] = (st.st_size, st.st_mtime_ns, st.st_ino)
    return out


def written_bytes(before: dict[str, tuple[int, int, int]], after: dict[str, tuple[int, int, int]]) -> int:
    """Bytes of the files that are new or were replaced (publish writes tmp + rename: a new inode)."""
    return sum(meta[0] for rel, meta in after.items() if before.get(rel) != meta)


@dataclass
class Published:
    run: Measured
    written: int
    entries: int
    events: int


def publish_measured(ledger: Path, dest: Path, keys: Path, log: Path) -> Published:
    """`ledger publish DEST` as a subprocess, with the bytes it wrote into DEST."""
    before = _files(dest) if dest.exists() else {}
    run = cli(["publish", str(dest), "--ledger", str(ledger), "--keys", str(keys)], log)
    counts = re.search(r"published ([\d,]+) entr\w+ \(([\d,]+) event", run.stdout)
    entries, events = (int(g.replace(",", "")) for g in counts.groups()) if counts else (0, 0)
    return Published(run, written_bytes(before, _files(dest)), entries, events)


def copy_parquet(ledger: Path, dest: Path, out: Path, log: Path) -> Measured:
    """Baseline: `cp` of exactly the Parquet files the published manifest names (nothing checked)."""
    manifest = json.loads((dest / "manifest.json").read_bytes())
    rels = [item["path"].removeprefix("data/") for item in manifest["files"]]
    out.mkdir(parents=True)
    proc = run_measured(["cp", "--parents", "-t", str(out), *rels], stderr=log, cwd=ledger)
    if proc.returncode != 0:
        raise RuntimeError(f"cp of {len(rels)} Parquet files exited {proc.returncode} (log {log})")
    return proc


def make_log_key(ledger: Path, keys: Path, log: Path) -> str:
    """A log key made by the project's own command, named for the log's origin; its vkey."""
    from runledger.ledger.publish import log_origin
    from runledger.ledger.store import Ledger

    origin = log_origin(Ledger.open(ledger).ledger_id)
    cli(["keys", "init", "--name", origin, "--keys", str(keys)], log)
    (pub,) = keys.glob("*.pub")
    return pub.read_text().strip()


# --- remote checks --------------------------------------------------------------------------------

# One inclusion proof, as a verifier that holds only the URL, the log key, the entry's index and the
# event's digest would check it: the checkpoint, the entry's bundle and its audit path's tiles.
_PROOF_CHILD = """
import json, sys, time, urllib.request
from pathlib import Path
from runledger.ledger.log_checkpoint import parse_and_verify_checkpoint
from runledger.ledger.merkle import leaf_hash, verify_inclusion
from runledger.ledger.tiles import TILE_WIDTH, decode_bundle, entries_path, inclusion_proof_from_tiles, tile_path, tile_width
base, vkey, index, want_sha256 = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
def get(rel):
    with urllib.request.urlopen(base + rel, timeout=30) as response:
        return response.read()
t0 = time.perf_counter()
checkpoint = parse_and_verify_checkpoint(get("checkpoint"), vkey)
width = tile_width(0, index // TILE_WIDTH, checkpoint.size)
entry = decode_bundle(get(entries_path(index // TILE_WIDTH, width)), width)[index % TILE_WIDTH]
proof = inclusion_proof_from_tiles(lambda l, n, w: get(tile_path(l, n, w)), index, checkpoint.size)
verify_inclusion(leaf_hash(entry), index, checkpoint.size, proof, checkpoint.root)
doc = json.loads(entry)
assert doc.get("salted_sha256", doc.get("sha256")) == want_sha256, "the entry commits to other bytes"
seconds = time.perf_counter() - t0
status = Path("/proc/self/status").read_text()
peak_kb = int(next(line.split()[1] for line in status.splitlines() if line.startswith("VmHWM")))
print(json.dumps({"s": seconds, "peak_rss_mb": peak_kb / 1024, "hashes": len(proof)}))
"""


def child(script_args: list[str], log: Path) -> dict[str, float]:
    """``bench.bench_remote``'s child (remote or local verify; time after imports, VmHWM), or the
    proof child above; stderr kept in the log, and its last line raised on failure."""
    proc = subprocess.run([*CAP, sys.executable, "-c", *script_args], capture_output=True, text=True)
    with log.open("a") as handle:
        handle.write(proc.stderr)
    if proc.returncode != 0:
        tail = proc.stderr.strip().splitlines()[-1:] or ["(no output)"]
        raise RuntimeError(f"check exited {proc.returncode}: {tail[0]} (traceback in {log})")
    return dict(json.loads(proc.stdout.strip().splitlines()[-1]))


def verify_child(args: list[str], log: Path) -> dict[str, float]:
    from bench.bench_remote import _CHILD

    return child([_CHILD, *args], log)


def proof_target(ledger: Path, dest: Path) -> tuple[str, str, int, str]:
    """The event the proof is of (the config change that switched the dispatcher, mid-run, or the
    middle event of the log): its id, source, leaf index and the digest its entry names (the
    canonical bytes' SHA-256, salted with the event's salt: what ``prove --salt-out`` hands over)."""
    import pyarrow.dataset as ds

    from runledger.ledger.publish import load_published
    from runledger.ledger.query import Reader
    from runledger.ledger.redaction import entry_digest

    reader = Reader(ledger)
    rows = (
        reader.sql(
            "SELECT id, source, stream, stream_seq, canonical FROM events WHERE type = 'runledger.config.changed' "
            "ORDER BY step DESC LIMIT 1"
        ).rows
        or reader.sql(
            "SELECT id, source, stream, stream_seq, canonical FROM events LIMIT 1 OFFSET "
            "(SELECT count(*) // 2 FROM events)"
        ).rows
    )
    event_id, source, stream, seq, canonical = rows[0]
    index = load_published(ledger, dest).leaf_of(stream, seq)
    assert index is not None, f"{event_id} is not in the published log"
    salts = ds.dataset(ledger / "salts", format="parquet", partitioning="hive").to_table(
        columns=["salt"], filter=(ds.field("stream") == stream) & (ds.field("stream_seq") == seq)
    )
    salt = salts.column("salt").to_pylist()[0] if salts.num_rows else None
    return event_id, source, index, entry_digest(canonical.encode(), salt)


def prove_offline(
    ledger: Path, dest: Path, event_id: str, source: str, vkey: str, work: Path, log: Path
) -> dict[str, float]:
    """Baseline: the same entry's tlog-proof made from DEST on disk and checked offline (nothing fetched)."""
    proof = work / "proof.tlog"
    made = cli(
        [
            "prove",
            "inclusion",
            event_id,
            "--source",
            source,
            "--ledger",
            str(ledger),
            "--format",
            "tlog-proof",
            "--published",
            str(dest),
            "-o",
            str(proof),
        ],
        log,
    )
    checked = cli(["verify-proof", str(proof), "--log-key", vkey], log)
    return {"prove_s": made.seconds, "verify_s": checked.seconds, "bytes": proof.stat().st_size}


# --- the benchmark --------------------------------------------------------------------------------


Row = dict[str, str]


def _mb(n: float) -> str:
    return f"{n / 1e6:,.1f} MB"


class Bench:
    """One run's work folder, log key, local HTTP server and figures."""

    def __init__(self, spool: Path, work: Path) -> None:
        self.spool, self.work, self.log = spool, work, work / "bench.log"
        self.ledger, self.dest, self.keys = work / "ledger", work / "site", work / "keys"
        self.f: Row = {}
        work.mkdir(parents=True, exist_ok=True)
        self.vkey = ""
        self.events = 0  # published so far
        self.counter = [0]
        self.url = ""
        self.state = work / "remote-verify.json"

    def copy_base(self, base: Path) -> None:
        copy_s = _copy_tree(base, self.ledger)
        self.f["copy the ledger to work on (cp -a)"] = f"{copy_s:.1f} s, {_mb(tree_bytes(self.ledger))}"
        self.vkey = make_log_key(self.ledger, self.keys, self.log)

    def grow_in_stages(self, stages: int) -> None:
        """The ledger built from the spool but its last 1,000 steps in ``stages`` equal slices, published
        after each (as an operator publishing after every ingest would): each publish only what is new."""
        from runledger.workflows.simulate import RUN_ID

        cut = find_cut(self.spool, RUN_ID)[0]
        runs: list[Published] = []
        ingest_s = 0.0
        for k in range(1, stages + 1):
            prefix = self.work / "spool-prefix"
            prefix_spool(self.spool, prefix, round(cut * k / stages))
            ingest_s += cli(
                ["ingest", "spool", "--spool", str(prefix), "--ledger", str(self.ledger)], self.log
            ).seconds
            shutil.rmtree(prefix)
            if k == 1:
                self.vkey = make_log_key(self.ledger, self.keys, self.log)
            runs.append(publish_measured(self.ledger, self.dest, self.keys, self.log))
            self.events += runs[-1].events
            print(f"  stage {k}/{stages}: {_publish_row(runs[-1])}", flush=True)
        self.f[f"ingest in {stages} slices (ledger ingest spool)"] = f"{ingest_s:.1f} s"
        self.f[f"publish after each of {stages} slices"] = (
            f"{sum(r.run.seconds for r in runs):.1f} s in all (each {min(r.run.seconds for r in runs):.1f}–"
            f"{max(r.run.seconds for r in runs):.1f} s), peak RSS {min(r.run.peak_rss_mb for r in runs):.0f}–"
            f"{max(r.run.peak_rss_mb for r in runs):.0f} MB, {_mb(sum(r.written for r in runs))} written"
        )
        self.f[f"the {stages} publishes, s / peak MB"] = ", ".join(
            f"{r.run.seconds:.0f}/{r.run.peak_rss_mb:.0f}" for r in runs
        )

    def publish_once_more(self, name: str) -> None:
        """From scratch to a fresh DEST (the ledger's other publish state untouched), then removed."""
        from runledger.ledger.publish import state_dir

        dest = self.work / "site-from-scratch"
        step(self.f, name, lambda: _publish_row(publish_measured(self.ledger, dest, self.keys, self.log)))
        shutil.rmtree(state_dir(self.ledger, dest), ignore_errors=True)
        shutil.rmtree(dest, ignore_errors=True)

    def publish(self, name: str) -> None:
        def run() -> str:
            published = publish_measured(self.ledger, self.dest, self.keys, self.log)
            self.events += published.events
            return _publish_row(published)

        step(self.f, name, run)

    def remote(self, name: str) -> None:
        args = ["remote", self.url, self.vkey, str(self.state)]
        step(self.f, name, lambda: _remote_row(verify_child(args, self.log), self.counter))

    def baseline_copy(self) -> None:
        copied = copy_parquet(self.ledger, self.dest, self.work / "copy", self.log)
        self.f["baseline: cp of the same Parquet files"] = (
            f"{copied.seconds:.1f} s, {copied.peak_rss_mb:.0f} MB peak, {_mb(tree_bytes(self.work / 'copy'))} written"
        )
        shutil.rmtree(self.work / "copy")

    def fetch_all(self) -> str:
        """Baseline for remote verify: the same bytes downloaded, nothing checked (in this process)."""
        started = time.perf_counter()
        for path in sorted(p for p in self.dest.rglob("*") if p.is_file()):
            with urllib.request.urlopen(self.url + str(path.relative_to(self.dest)), timeout=60) as response:
                while response.read(1 << 20):
                    pass
        seconds, self.counter[0], fetched = time.perf_counter() - started, 0, self.counter[0]
        return f"{seconds:.2f} s, {_mb(fetched)} fetched"

    def grow(self) -> None:
        grow = cli(["ingest", "spool", "--spool", str(self.spool), "--ledger", str(self.ledger)], self.log)
        self.f["the next 1,000 steps ingested (ledger ingest spool)"] = f"{grow.seconds:.1f} s"

    def proofs(self) -> None:
        event_id, source, index, digest = proof_target(self.ledger, self.dest)
        self.f["proof of"] = f"{event_id} (leaf {index:,})"
        args = [_PROOF_CHILD, self.url, self.vkey, str(index), digest]
        step(
            self.f,
            "one inclusion proof fetched and checked remotely",
            lambda: _proof_row(child(args, self.log), self.counter),
        )
        off = prove_offline(self.ledger, self.dest, event_id, source, self.vkey, self.work, self.log)
        self.f["baseline: its offline tlog-proof (prove; verify-proof)"] = (
            f"{off['prove_s']:.2f} s; {off['verify_s']:.2f} s (CLI, imports included), {off['bytes']:,.0f} B"
        )


def run_bench(spool: Path, work: Path, *, base: Path | None, stages: int, local_verify: bool) -> Row:
    """Every figure, in order: publish from scratch (or in stages, then once from scratch beside),
    cp baseline, remote verify from scratch (and the local baseline), the next 1,000 steps ingested,
    publish again, remote verify again, the proof."""
    from bench.bench_remote import _serve

    b = Bench(spool, work)
    if base is not None:
        b.copy_base(base)
        b.publish("publish from scratch")
    else:
        b.grow_in_stages(stages)
        b.publish_once_more("publish from scratch (one go, fresh DEST)")
    b.baseline_copy()
    b.f |= _per_event(b.dest, b.events, "before the 1,000 steps")
    server = _serve(b.dest, b.counter)
    b.url = f"http://127.0.0.1:{server.server_address[1]}/"
    try:
        b.remote("remote verify from scratch")
        step(b.f, "baseline: every file of DEST fetched over HTTP, unchecked", b.fetch_all)
        if local_verify:
            local = ["local", str(b.ledger)]
            step(
                b.f,
                "baseline: local verify (verify_ledger)",
                lambda: _remote_row(verify_child(local, b.log), None),
            )
        b.grow()
        b.publish("publish after 1,000 steps")
        b.publish("baseline: publish with nothing new")
        b.remote("remote verify after 1,000 steps")
        b.remote("baseline: remote verify with nothing new")
        b.f |= _per_event(b.dest, b.events, "after the 1,000 steps")
        b.proofs()
    finally:
        server.shutdown()
        server.server_close()
    return b.f


def step(f: Row, name: str, measure: Callable[[], str]) -> None:
    """One figure; a failure is a figure too (its one line), and the run goes on."""
    try:
        f[name] = measure()
    except (RuntimeError, subprocess.SubprocessError, OSError) as exc:
        f[name] = f"FAILED: {exc}"
    print(f"  {name}: {f[name]}", flush=True)


def _publish_row(p: Published) -> str:
    return (
        f"{p.run.seconds:.1f} s (CPU {p.run.cpu_s:.1f} s), {p.run.peak_rss_mb:.0f} MB peak, "
        f"{_mb(p.written)} written, {p.entries:,} entries ({p.events:,} events)"
    )


def _remote_row(r: dict[str, float], counter: list[int] | None) -> str:
    fetched = ""
    if counter is not None:
        fetched, counter[0] = f", {_mb(counter[0]) if counter[0] > 1e5 else f'{counter[0]:,} B'} fetched", 0
    return f"{r['s']:.2f} s, {r['peak_rss_mb']:.0f} MB peak{fetched}"


def _proof_row(r: dict[str, float], counter: list[int]) -> str:
    return _remote_row(r, counter) + f", {r['hashes']:.0f} hashes in the audit path"


def _per_event(dest: Path, events: int, when: str) -> Row:
    """Bundle and tile bytes per event and per entry; full bundles alone too (partial bundles repeat
    entries: one is written for every size a checkpoint was published at)."""
    bundles = dest / "tile" / "entries"
    bundle_bytes = tree_bytes(bundles)
    full = [p for p in bundles.rglob("*") if p.is_file() and not p.parent.name.endswith(".p")]
    tile_bytes = tree_bytes(dest / "tile") - bundle_bytes
    entries = json.loads((dest / "manifest.json").read_bytes())["log_size"]
    full_bytes = sum(p.stat().st_size for p in full)
    return {
        f"log entries / events ({when})": f"{entries:,} / {events:,}",
        f"entry bundle bytes per event ({when})": (
            f"{bundle_bytes / events:.1f} ({bundle_bytes / entries:.1f} per entry; full bundles alone "
            f"{full_bytes / (256 * len(full)):.1f} per entry)"
            if full
            else f"{bundle_bytes / events:.1f}"
        ),
        f"tile bytes per event ({when})": f"{tile_bytes / events:.1f} ({tile_bytes / entries:.1f} per entry)",
        f"data MB in DEST ({when})": _mb(tree_bytes(dest / "data")),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("what", nargs="?", choices=["bench", "build"], default="bench")
    ap.add_argument(
        "--steps", type=int, default=39_000, help="steps to simulate when building (10%% of the run)"
    )
    ap.add_argument(
        "--ledger", type=Path, help="a ledger of SPOOL but its last 1,000 steps (build makes one)"
    )
    ap.add_argument("--spool", type=Path, help="the whole run's spool (needed with --ledger)")
    ap.add_argument("--workdir", type=Path, help="where the work goes (default: a temp dir)")
    ap.add_argument("--no-local-verify", action="store_true", help="skip the local verify baseline")
    ap.add_argument("--stages", type=int, default=0, help="build and publish the ledger in N slices of SPOOL")
    ap.add_argument("--cap-mb", type=int, help="address-space limit of every child (prlimit --as)")
    args = ap.parse_args()
    if args.cap_mb:
        CAP[:] = ["prlimit", f"--as={args.cap_mb << 20}", "--"]
    if args.ledger is not None and args.spool is None:
        ap.error("--ledger needs --spool (the whole run's spool, to ingest its last 1,000 steps from)")
    if args.workdir is not None:
        args.workdir.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="bench-public-full-", dir=args.workdir))
    print(f"work in {work} (subprocess logs: {work / 'bench.log'})", flush=True)
    if args.what == "build":
        build(work, args.steps, work / "build.log", work / "ledger")
        return
    base, spool = args.ledger, args.spool
    if spool is None:
        (work / "built").mkdir()
        spool = work / "built" / "spool"
        if args.stages:  # the spool alone: the stages ingest it
            cli(
                ["simulate", "reference-535b", "--steps", str(args.steps), "--spool", str(spool)],
                work / "bench.log",
            )
        else:
            base = build(work / "built", args.steps, work / "bench.log").base
    started = time.perf_counter()
    figures = run_bench(
        spool,
        work / "run",
        base=None if args.stages else base,
        stages=args.stages,
        local_verify=not args.no_local_verify,
    )
    print(f"done in {time.perf_counter() - started:.0f} s\n\n| figure | value |\n|---|---|")
    for name, value in figures.items():
        print(f"| {name} | {value} |")


if __name__ == "__main__":
    main()
