"""One headless Chromium for the web tests, its temporary files in a folder of its own.

Chromium leaves a ``org.chromium.Chromium.XXXXXX`` folder in the system's temporary folder each time
chromedriver ends it (82 of them after a few CI runs here): its ``TMPDIR`` is a folder this helper
makes and removes when the driver quits.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]
HEADLESS = ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage")


def browser_binaries() -> tuple[str, str] | str:
    """(chromium, chromedriver), installing them with scripts/browser.sh when missing; else why not."""

    def find() -> tuple[str | None, str | None]:
        return shutil.which("chromium") or shutil.which("chromium-browser"), shutil.which("chromedriver")

    chromium, driver = find()
    if not (chromium and driver):
        done = subprocess.run(
            [str(ROOT / "scripts" / "browser.sh"), "install"], capture_output=True, text=True
        )
        chromium, driver = find()
        if not (chromium and driver):
            return (
                "no headless browser: "
                + (done.stderr.strip().splitlines() or ["scripts/browser.sh found none"])[-1]
            )
    return chromium, driver


def chromium(args: Sequence[str], logs: dict[str, str]) -> Any:
    """A headless Chromium driver (skips the test where none can be had) with ``args`` beside
    ``HEADLESS`` and the ``logs`` it keeps (``goog:loggingPrefs``); ``quit()`` removes its files."""
    found = browser_binaries()
    if isinstance(found, str):
        pytest.skip(found)
    binary, chromedriver = found
    from selenium import webdriver

    class Chrome(webdriver.Chrome):
        def quit(self) -> None:
            try:
                super().quit()
            finally:
                shutil.rmtree(folder, ignore_errors=True)

    options = webdriver.ChromeOptions()
    options.binary_location = binary
    for arg in (*HEADLESS, *args):
        options.add_argument(arg)
    options.set_capability("goog:loggingPrefs", logs)
    folder = tempfile.mkdtemp(prefix="runledger-chromium-")
    service = webdriver.ChromeService(executable_path=chromedriver, env={**os.environ, "TMPDIR": folder})
    try:
        return Chrome(options=options, service=service)
    except BaseException:
        shutil.rmtree(folder, ignore_errors=True)
        raise
