"""A child process's own wall time, CPU time and peak RSS, for the benchmarks that run one.

``os.wait4``'s ``ru_maxrss`` is no use for the child of a big process: Linux carries into a process's
maximum the RSS it had before ``exec`` (the copy of its parent), so a benchmark holding 800 MB saw
``python -c pass`` at 800 MB. GNU time (Debian's ``time`` package) forks the command from its own
small process and reports the child's peak from there.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

GNU_TIME = shutil.which("time", path="/usr/bin:/bin")


@dataclass
class Measured:
    seconds: float
    cpu_s: float  # user + system: the machine is shared, so wall time alone overstates the work
    peak_rss_mb: float
    stdout: str
    returncode: int


def run_measured(
    cmd: list[str], *, stderr: Path | None = None, env: dict[str, str] | None = None, cwd: Path | None = None
) -> Measured:
    """Run ``cmd`` to completion (stdout captured, stderr appended to ``stderr`` or merged into
    stdout). Without GNU time the peak RSS falls back to ``wait4``'s, an upper bound (see above)."""
    with tempfile.TemporaryDirectory(prefix="bench-measure-") as tmp:
        report = Path(tmp) / "time"
        wrapped = [GNU_TIME, "-f", "%U %S %M", "-o", str(report), *cmd] if GNU_TIME else cmd
        err = open(stderr, "ab") if stderr is not None else None  # noqa: SIM115 (closed below)
        try:
            started = time.perf_counter()
            proc = subprocess.Popen(
                wrapped, stdout=subprocess.PIPE, stderr=err or subprocess.STDOUT, env=env, cwd=cwd
            )
            assert proc.stdout is not None
            out = proc.stdout.read()
            _, status, usage = os.wait4(proc.pid, 0)
            elapsed = time.perf_counter() - started
        finally:
            if err is not None:
                err.close()
        code = os.waitstatus_to_exitcode(status)
        if GNU_TIME and report.exists() and report.read_text().split():
            # GNU time writes "Command exited with non-zero status N" first when it failed.
            user, system, peak_kib = report.read_text().split()[-3:]
            return Measured(elapsed, float(user) + float(system), int(peak_kib) / 1024, out.decode(), code)
        return Measured(elapsed, usage.ru_utime + usage.ru_stime, usage.ru_maxrss / 1024, out.decode(), code)
