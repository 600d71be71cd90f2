"""The fence around private names: each private name of a library that gptrun relies on is
listed once, with the version it was checked against and the test that guards it, so that
`gptrun doctor` can say which ones an installed version no longer has (the code that uses them
then fails with the same line instead of falling back silently).

Three fences use it: `gptcore.private_torch`, `experiments.private_ray` and
`experiments.private_optuna`, one per package."""

from __future__ import annotations

import importlib
import inspect
from dataclasses import dataclass

from gptcore.errors import UserError


@dataclass(frozen=True)
class Private:
    """`module`.`name`, where `name` is a dotted path inside the module. A last part written
    `self._x` is an attribute that the class before it sets on its instances, and a name in
    double quotes is text (a command-line flag) that the module's source holds: both are checked
    in the source, since no instance or process exists yet."""

    module: str
    name: str
    checked: str  # "ray 2.60.0": the package and version whose source it was read in
    test: str  # the test that fails if it changes meaning

    @property
    def dotted(self) -> str:
        return f"{self.module}.{self.name}"

    def problem(self) -> str | None:
        """None when the name is there; else one line that says what is missing and why it matters."""
        try:
            value = importlib.import_module(self.module)
        except ImportError as err:
            return self._missing(f"module {self.module} not importable: {err}")
        for part in _parts(self.name):
            if part.startswith(("self.", '"')):
                source = inspect.getsource(value)
                if part not in source:
                    return self._missing(f"{getattr(value, '__name__', value)} has no {part} in its source")
                continue
            if not hasattr(value, part):
                return self._missing(f"no {part}")
            value = getattr(value, part)
        return None

    def _missing(self, why: str) -> str:
        return (
            f"{self.dotted}: {why} (gptrun was checked against {self.checked}; guarded by "
            f"{self.test}): install the pinned version (pip install -e .) or report it"
        )


def require(entry: Private) -> None:
    """Raise one line naming `entry` if this installation lacks it: the use that follows would
    otherwise fail deep inside the library, or a fallback would change behaviour silently."""
    problem = entry.problem()
    if problem is not None:
        raise UserError(problem)


def missing(entries: list[Private]) -> list[str]:
    """One line per fenced name that this installation lacks."""
    return [p for p in (e.problem() for e in entries) if p is not None]


def _parts(name: str) -> list[str]:
    """'Class.self._x' -> ['Class', 'self._x']; '"--flag"' -> ['"--flag"'] (text the source has)."""
    if name.startswith('"'):
        return [name]
    head, sep, attr = name.partition(".self.")
    return [*head.split("."), *([f"self.{attr}"] if sep else [])]
