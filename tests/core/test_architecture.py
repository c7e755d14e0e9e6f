"""The house's rules (docs/architecture.md), read from the checkout's own imports.

Every ``import``/``from … import`` of every package file is parsed (module level, inside functions and
under ``TYPE_CHECKING`` alike: an import in a function is still an arrow), resolved to the file it
names in the checkout, and held against the parts and the arrows allowed between them. A rule broken
fails here with the files and the names taken, so the picture in docs/architecture.md stays true.
"""

from __future__ import annotations

import ast
import os
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
PACKAGES = ("runledger", "cli", "ingest", "ledger", "schemas", "trainer")  # the folders
FOLDERS = PACKAGES[1:]  # each the package runledger.<folder>, through runledger/<folder> -> ../<folder>
ROOT = "runledger"  # the one top-level import name (issue 41)
MAX_FUNCTION_BODY_LINES = 80  # statements after the signature and docstring

# The parts, bottom up. A module belongs to the part of the longest prefix it starts with.
PARTS: list[tuple[str, tuple[str, ...]]] = [
    ("base", ("runledger.schemas.durable",)),
    ("catalogue", ("runledger.schemas",)),
    (
        "bus",
        (
            "runledger.ingest.bus",
            "runledger.ingest.spool",
            "runledger.ingest.kafka_sink",
            "runledger.ingest.kafka_config",
        ),
    ),
    ("workflows", ("runledger.workflows",)),
    ("client", ("runledger",)),
    ("trainer", ("runledger.trainer",)),
    (
        "ingesters",
        (
            "runledger.ingest.ingester",
            "runledger.ingest.spool_ingester",
            "runledger.ingest.kafka_ingester",
            "runledger.ingest.kafka_replay",
        ),
    ),
    ("sources", ("runledger.ingest",)),
    ("ledger", ("runledger.ledger",)),
    ("cli", ("runledger.cli",)),
]

# Which parts each part may import (itself always). Everything else is a rule broken.
ALLOWED: dict[str, set[str]] = {
    "base": set(),
    "catalogue": {"base"},
    "bus": {"base", "catalogue"},
    "client": {"base", "catalogue", "bus"},
    "trainer": {"base", "catalogue", "bus", "client"},
    "sources": {
        "base",
        "catalogue",
        "bus",
    },  # (the W&B row mapping is the catalogue's: no arrow up to the client)
    "ledger": {"base", "catalogue"},
    "ingesters": {"base", "catalogue", "bus", "ledger"},
    "workflows": {"base", "catalogue", "bus", "client", "trainer", "sources", "ledger", "ingesters"},
    "cli": {"base", "catalogue", "bus", "client", "trainer", "sources", "ledger", "ingesters", "workflows"},
}


def part_of(module: str) -> str:
    """The part of the longest prefix the module starts with (``runledger.ledger.x`` is the ledger's,
    ``runledger.client`` the client's)."""
    matches = [
        (len(p), part)
        for part, prefixes in PARTS
        for p in prefixes
        if module == p or module.startswith(p + ".")
    ]
    if matches:
        return max(matches)[1]
    raise AssertionError(f"{module} is on no part of docs/architecture.md")


@dataclass
class House:
    files: dict[str, Path]  # module name -> file
    arrows: dict[str, set[str]] = field(default_factory=lambda: defaultdict(set))
    where: dict[tuple[str, str], int] = field(default_factory=dict)  # (from, to) -> line
    unresolved: list[str] = field(default_factory=list)


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(REPO).with_suffix("").parts)
    if parts[0] != ROOT:
        parts.insert(0, ROOT)  # ledger/store.py is runledger/ledger/store.py: runledger.ledger.store
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _resolve(files: dict[str, Path], name: str) -> str | None:
    """The module a dotted name lands in (``a.b.C`` -> ``a.b``), None when it is not first-party."""
    while name:
        if name in files:
            return name
        name = name.rpartition(".")[0]
    return None


def _imported_names(tree: ast.AST, module: str, is_package: bool) -> list[tuple[str, int]]:
    package = module if is_package else module.rpartition(".")[0]
    names: list[tuple[str, int]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names += [(alias.name, node.lineno) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                target = ".".join([*base, *([node.module] if node.module else [])])
            else:
                target = node.module or ""
            names += [(f"{target}.{alias.name}", node.lineno) for alias in node.names]
    return names


def read_house() -> House:
    files = {
        _module_name(path): path
        for package in PACKAGES
        for path in sorted((REPO / package).rglob("*.py"))
        if "__pycache__" not in path.parts
    }
    house = House(files)
    for module, path in files.items():
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        for name, line in _imported_names(tree, module, path.name == "__init__.py"):
            if name.split(".")[0] != ROOT:
                continue  # the standard library or a third party
            target = _resolve(files, name)
            if target is None:
                house.unresolved.append(f"{path.relative_to(REPO)}:{line} {name}")
            elif target != module:
                house.arrows[module].add(target)
                house.where.setdefault((module, target), line)
    return house


@pytest.fixture(scope="module")
def house() -> House:
    return read_house()


def _cycles(arrows: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for root in sorted(arrows):
        if root in index:
            continue
        work = [(root, iter(sorted(arrows.get(root, ()))))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(arrows.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


# --- the rules ---------------------------------------------------------------------------------


def test_every_first_party_import_names_a_file_of_the_checkout(house: House) -> None:
    assert not house.unresolved, "imports a tool reading the checkout cannot follow:\n" + "\n".join(
        house.unresolved
    )


def test_every_package_file_is_on_a_part(house: House) -> None:
    for module in house.files:
        part_of(module)


def test_no_import_runs_from_a_lower_part_to_one_it_may_not_import(house: House) -> None:
    broken = [
        f"{house.files[a].relative_to(REPO)}:{house.where[(a, b)]} ({part_of(a)}) imports {b} ({part_of(b)})"
        for a, targets in sorted(house.arrows.items())
        for b in sorted(targets)
        if part_of(a) != part_of(b) and part_of(b) not in ALLOWED[part_of(a)]
    ]
    assert not broken, "arrows docs/architecture.md forbids:\n" + "\n".join(broken)


@pytest.mark.parametrize(
    ("lower", "higher"),
    [
        ("catalogue", "ledger"),  # the catalogue imports nothing of the ledger
        ("trainer", "ledger"),  # the trainer never imports the ledger
        ("client", "trainer"),  # the client never imports the trainer …
        ("client", "ledger"),  # … or the ledger
        ("ledger", "trainer"),
        ("ledger", "client"),
    ],
)
def test_named_rule_holds(house: House, lower: str, higher: str) -> None:
    assert higher not in ALLOWED[lower]  # the table itself keeps the rule
    taken = [
        f"{a} -> {b}"
        for a, targets in house.arrows.items()
        for b in targets
        if part_of(a) == lower and part_of(b) == higher
    ]
    assert not taken, taken


def test_no_import_circle(house: House) -> None:
    assert not _cycles(house.arrows), _cycles(house.arrows)


def test_the_cycle_finder_finds_a_circle() -> None:
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []


def test_the_rule_table_catches_an_arrow_it_forbids() -> None:
    assert part_of("runledger.trainer.loop") == "trainer" and part_of("runledger.ledger.store") == "ledger"
    assert "ledger" not in ALLOWED["trainer"]
    assert part_of("runledger.workflows.demo") == "workflows" and part_of("runledger.client") == "client"
    assert (
        part_of("runledger.ingest.spool_ingester") == "ingesters"
        and part_of("runledger.ingest.spool") == "bus"
    )


def test_no_function_body_over_the_limit() -> None:
    long = []
    for package in PACKAGES:
        for path in sorted((REPO / package).rglob("*.py")):
            tree = ast.parse(path.read_text(encoding="utf-8"))
            for node in ast.walk(tree):
                if not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                    continue
                body = node.body
                first = body[0]
                if len(body) > 1 and isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
                    first = body[1]  # the docstring is not the function's work
                lines = (node.end_lineno or node.lineno) - first.lineno + 1
                if lines > MAX_FUNCTION_BODY_LINES:
                    long.append(f"{path.relative_to(REPO)}:{node.lineno} {node.name}: {lines} lines")
    assert not long, f"functions over {MAX_FUNCTION_BODY_LINES} lines:\n" + "\n".join(long)


def test_the_wandb_bridge_uses_public_run_methods_only() -> None:
    """``runledger.wandb`` drives a ``Run`` like any user: no ``x._private`` but its own (``self._…``)."""
    path = REPO / "runledger" / "wandb.py"
    private = [
        f"{path.relative_to(REPO)}:{node.lineno} {ast.unparse(node)}"
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8")))
        if isinstance(node, ast.Attribute)
        and node.attr.startswith("_")
        and not node.attr.startswith("__")
        and not (isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"))
    ]
    assert not private, private


# --- one top-level import name (issue 41) ------------------------------------------------------------
BARE_SKIP = {"__pycache__", "build", "node_modules"}  # and every hidden folder: .venv, .git, .kafka, .go


def _python_files_of_the_checkout() -> list[Path]:
    """Every .py under the repository but the hidden folders (.venv …): packages, tests, bench, scripts.
    A symlinked folder (runledger/ledger -> ../ledger) is walked once, as its own folder."""
    found: list[Path] = []
    for folder, dirs, names in os.walk(REPO):
        dirs[:] = sorted(
            d for d in dirs if not d.startswith(".") and d not in BARE_SKIP and not d.endswith(".egg-info")
        )
        found += [Path(folder) / n for n in sorted(names) if n.endswith(".py")]
    return found


def _event_types() -> set[str]:
    """The catalogue's strings: type names such as the redaction's read like a module, and are data."""
    tree = ast.parse((REPO / "schemas" / "catalogue.py").read_text(encoding="utf-8"))
    return {n.value for n in ast.walk(tree) if isinstance(n, ast.Constant) and isinstance(n.value, str)}


def bare_names(source: str, modules: set[str], event_types: set[str]) -> list[tuple[int, str]]:
    """(line, name) of each import of a bare folder name (``import <folder>.x``, ``from <folder> …``),
    and of each string that is one (a ``-m`` target, a monkeypatch target ``"<folder>.x.NAME"``)."""
    found: list[tuple[int, str]] = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names if a.name.split(".")[0] in FOLDERS]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            if node.module.split(".")[0] in FOLDERS:
                found.append((node.lineno, node.module))
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            name = node.value.split(":")[0]
            if "." in name and name not in event_types and ".".join(name.split(".")[:2]) in modules:
                found.append((node.lineno, node.value))
    return sorted(found)


def test_no_python_file_imports_a_bare_folder_name(house: House) -> None:
    """A user's own folder of the same name, or another distribution's top-level package, must never
    stand in for ours: every first-party import, module string and ``-m`` target is under runledger."""
    inside = [m.split(".", 1)[1] for m in house.files if "." in m]  # without the leading "runledger."
    modules = {m for m in inside if m.split(".")[0] in FOLDERS}
    events = _event_types()
    taken = [
        f"{path.relative_to(REPO)}:{line} {name}"
        for path in _python_files_of_the_checkout()
        for line, name in bare_names(path.read_text(encoding="utf-8"), modules, events)
    ]
    assert not taken, "bare top-level names (write runledger.<folder>…):\n" + "\n".join(taken)


def test_the_bare_name_finder_finds_them() -> None:
    names = {"L": "ledger", "C": "cli", "S": "schemas"}  # spelled apart: the file itself holds none
    modules = {"{L}.store".format(**names), "{C}.main".format(**names), names["S"]}
    source = (
        "import {L}.store\nfrom {S} import x\nimport runledger.{L}.store\nargs = ['-m', '{C}.main']\n"
        "t = '{L}.store.COMMITS'\nkind = '{L}.redaction'\nfrom runledger.{C} import main\n"
    ).format(**names)
    found = bare_names(source, modules, {"{L}.redaction".format(**names)})
    expected = [(1, "{L}.store"), (2, "{S}"), (4, "{C}.main"), (5, "{L}.store.COMMITS")]
    assert found == [(line, name.format(**names)) for line, name in expected]


@pytest.mark.parametrize("folder", FOLDERS)
def test_each_folder_is_a_subpackage_of_runledger_in_the_checkout(folder: str) -> None:
    link = REPO / ROOT / folder
    assert link.is_symlink() and link.resolve() == REPO / folder, f"{link} is not the symlink -> ../{folder}"


def figures() -> str:
    """The figures the closing notes quote: ``python -m tests.core.test_architecture``."""
    house = read_house()
    between: dict[tuple[str, str], int] = defaultdict(int)
    for a, targets in house.arrows.items():
        for b in targets:
            if part_of(a) != part_of(b):
                between[(part_of(a), part_of(b))] += 1
    arrows = sum(len(targets) for targets in house.arrows.values())
    lines = [f"{len(house.files)} modules, {arrows} import arrows, {len(between)} arrows between parts"]
    lines += [f"  {a:>9} -> {b:<9} {n}" for (a, b), n in sorted(between.items())]
    return "\n".join(lines)


if __name__ == "__main__":
    print(figures())
