"""The Python floor: pyproject's `requires-python` is a version the code runs on (every module it
imports exists there), the one ruff checks the code against, and no newer than the tests' own."""

from __future__ import annotations

import ast
import sys
import tomllib

from packaging.specifiers import SpecifierSet

from tests.conftest import REPO

# Standard-library modules newer than some Python 3 still in use, with the version that added them.
NEWER_STDLIB = {"tomllib": (3, 11), "zoneinfo": (3, 9), "graphlib": (3, 9)}


def pyproject() -> dict:
    return tomllib.loads((REPO / "pyproject.toml").read_text())


def floor() -> tuple[int, ...]:
    (spec,) = SpecifierSet(pyproject()["project"]["requires-python"])
    assert spec.operator == ">=", spec
    return tuple(int(part) for part in spec.version.split(".")[:2])


def imported_modules() -> set[str]:
    names = set()
    for path in [*(REPO / "gptcore").rglob("*.py"), *(REPO / "experiments").rglob("*.py")]:
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import):
                names |= {alias.name.partition(".")[0] for alias in node.names}
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                names.add(node.module.partition(".")[0])
    return names


def test_the_floor_has_every_standard_module_the_code_imports():
    needed = {name: version for name, version in NEWER_STDLIB.items() if name in imported_modules()}
    assert "tomllib" in needed  # gptcore.config reads TOML with it
    too_new = {name: version for name, version in needed.items() if version > floor()}
    assert not too_new, f"requires-python >= {floor()} but the code imports {too_new}"


def test_ruff_checks_the_floor_and_the_tests_run_at_or_above_it():
    assert pyproject()["tool"]["ruff"]["target-version"] == "py{}{}".format(*floor())
    assert sys.version_info[:2] >= floor()
