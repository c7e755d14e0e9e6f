"""runledger.ledger.duck: DuckDB never reaches for the network, and only DuckDB-signed extensions load."""

from __future__ import annotations

import shutil
from pathlib import Path

import duckdb
import pytest

from runledger.ledger import duck

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


def _allows_unsigned(con: duckdb.DuckDBPyConnection) -> bool:
    row = con.execute(
        "SELECT value FROM duckdb_settings() WHERE name = 'allow_unsigned_extensions'"
    ).fetchone()
    return row is not None and row[0] == "true"


def test_a_binary_is_signature_checked_once_and_again_after_any_change(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    original, other = duck.extension_file("sqlite_scanner"), duck.extension_file("ducklake")
    copy = tmp_path / original.name
    shutil.copyfile(original, copy)
    monkeypatch.setattr(duck, "extension_file", lambda name: copy)
    monkeypatch.setattr(duck, "CHECKED_FILE", tmp_path / "checked.json")
    first = duck.connect(extensions=["sqlite_scanner"])
    assert not _allows_unsigned(first)  # DuckDB checked the signature
    again = duck.connect(extensions=["sqlite_scanner"])
    assert _allows_unsigned(again)  # the same file, unchanged: not checked twice
    again.execute("SET enable_external_access = false")
    with pytest.raises(duckdb.Error, match="disabled"):  # and nothing else loads once SQL is locked
        again.execute(f"LOAD '{other.as_posix()}'")
    # Replaced by a forged copy (written beside it and renamed over: editing a loaded binary in
    # place would crash this process, which has it mapped).
    forged = tmp_path / "forged"
    data = bytearray(original.read_bytes())
    data[len(data) // 2] ^= 0x01
    forged.write_bytes(bytes(data))
    forged.replace(copy)
    with pytest.raises(duckdb.Error, match=r"(?i)signature"):
        duck.connect(extensions=["sqlite_scanner"])
    (tmp_path / "intact").write_bytes(original.read_bytes())
    (tmp_path / "intact").replace(copy)
    (tmp_path / "checked.json").write_text("[damaged")  # damaged notes: checked again, not trusted
    assert not _allows_unsigned(duck.connect(extensions=["sqlite_scanner"]))
    assert _allows_unsigned(duck.connect(extensions=["sqlite_scanner"]))
