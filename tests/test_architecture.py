"""docs/architecture.md's picture of ``wtransfer/engines/`` is the code's: its generated block, the files its
path of a round names, and rooms that never import each other in a circle."""

from __future__ import annotations

import importlib.util
import re
from graphlib import CycleError
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("architecture", ROOT / "tools" / "architecture.py")
architecture = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(architecture)


def test_the_generated_picture_matches_the_code():
    assert architecture.block(architecture.DOC.read_text()) == architecture.picture(), (
        "docs/architecture.md's engines layout is stale: run python tools/architecture.py --write")


def test_every_folder_of_engines_is_a_room_with_a_job():
    found = architecture.rooms()
    folders = {p.name + "/" for p in architecture.ENGINES.iterdir() if (p / "__init__.py").is_file()}
    assert folders <= set(found)
    assert all(found[room]["job"] for room in found), {room: e["job"] for room, e in found.items()}


def test_the_path_of_a_round_names_files_that_exist():
    text = architecture.DOC.read_text()
    section = text[text.index("The path of one round"):]
    section = section[:section.index("\n## ", 1)]
    named = set(re.findall(r"`([a-z_]+/[a-z_]+\.py)`", section))
    assert len(named) >= 10, named
    missing = sorted(p for p in named if not (architecture.ENGINES / p).is_file())
    assert not missing, f"docs/architecture.md names files that do not exist: {missing}"


def test_a_circle_between_rooms_is_refused():
    rooms = {"a/": {"imports": {"b/"}}, "b/": {"imports": {"a/"}}, "toolkit": {"imports": set()}}
    with pytest.raises(CycleError):
        architecture.floors(rooms)
    assert architecture.floors({"a/": {"imports": {"b/"}}, "b/": {"imports": set()},
                                "toolkit": {"imports": set()}}) == ["a/", "b/", "toolkit"]


def test_imports_are_read_through_lazy_names_relative_imports_and_import_module():
    """An upward import hidden behind the toolkit's lazy names, a relative import or ``import_module`` still counts:
    from rounds/, each of these would close a circle with trainer/."""
    import ast

    exports = architecture._lazy_exports()
    source = ("from wtransfer.engines import create_trainer\nfrom ..trainer import engine\n"
              "import importlib\nimportlib.import_module('wtransfer.engines.trainer.client')\n")
    modules = architecture._imported_modules(ast.parse(source), "wtransfer.engines.rounds", exports)
    rooms = {architecture._room_of_module(m) for m in modules} - {None}
    assert rooms == {"toolkit", "trainer/"}, modules
    assert "wtransfer.engines.trainer.create" in modules
    assert "wtransfer.engines.trainer.engine" in modules and "wtransfer.engines.trainer.client" in modules
