"""ledger.duck: DuckDB never reaches for the network, and only DuckDB-signed extensions load."""

from __future__ import annotations

import shutil
from pathlib import Path

import duckdb
import pytest

from ledger import duck

EXTENSIONS = ["httpfs", "ducklake", "postgres_scanner", "sqlite_scanner"]


def test_connections_are_offline_and_keep_extensions_in_the_checkout() -> None:
    con = duck.connect()
    settings = dict(
        con.execute(
            "SELECT name, value FROM duckdb_settings() WHERE name IN ('autoinstall_known_extensions',"
            " 'autoload_known_extensions', 'allow_community_extensions', 'allow_unsigned_extensions',"
            " 'extension_directory')"
        ).fetchall()
    )
    assert settings == {
        "autoinstall_known_extensions": "false",
        "autoload_known_extensions": "false",
        "allow_community_extensions": "false",
        "allow_unsigned_extensions": "false",
        "extension_directory": duck.EXTENSION_DIR.as_posix(),
    }
    checkout = Path(duck.__file__).resolve().parent.parent
    assert duck.EXTENSION_DIR.is_relative_to(checkout)


def test_a_url_without_httpfs_is_refused_not_fetched() -> None:
    con = duck.connect()
    with pytest.raises(duckdb.Error, match="httpfs"):
        con.execute("SELECT * FROM read_parquet('http://127.0.0.1:9/nothing.parquet')").fetchall()


@pytest.mark.parametrize("name", EXTENSIONS)
def test_each_pinned_extension_loads_from_its_wheel(name: str) -> None:
    con = duck.connect(extensions=[name])
    loaded = con.execute(
        "SELECT loaded, install_mode FROM duckdb_extensions() WHERE extension_name = ?", [name]
    ).fetchone()
    assert loaded is not None and loaded[0] is True


def test_a_tampered_extension_binary_does_not_load(tmp_path: Path) -> None:
    original = duck.extension_file("sqlite_scanner")
    forged = tmp_path / original.name
    shutil.copyfile(original, forged)
    data = bytearray(forged.read_bytes())
    data[len(data) // 2] ^= 0x01  # one bit in the code, the signature block untouched
    forged.write_bytes(bytes(data))
    con = duck.connect()
    with pytest.raises(duckdb.Error, match=r"(?i)signature"):
        con.execute(f"LOAD '{forged.as_posix()}'")


def test_an_extension_with_no_wheel_says_which_to_install() -> None:
    with pytest.raises(duck.ExtensionMissing, match="duckdb-extension-spatial"):
        duck.extension_file("spatial")
