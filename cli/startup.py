"""Imported first by ``runledger.cli.main`` (before typer, rich and every command): from here on SIGINT/SIGTERM
follow the command's one policy (``runledger.signals.StopPolicy``), also while the rest imports;
a signal now ends the process at once with 128 + N and one line. ``runledger.cli.main`` ends this phase
(``signals.started``) when its own imports are done."""

from __future__ import annotations

from runledger import signals

signals.install(starting=True)
