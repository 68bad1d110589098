"""Names of SMP v1's API that smp has not built yet: importable, so that a v1 script loads, and
failing when used with a message saying what is missing (docs/guide.md, "SMP v1 keys")."""

from __future__ import annotations

from typing import Any, NoReturn


class NotBuiltYet(NotImplementedError):
    """A part of SMP v1's API that this version of smp does not have yet."""


def fail(name: str, what: str) -> NoReturn:
    raise NotBuiltYet(
        f"smp: {name} is not built yet ({what}); the name exists so that SMP v1 scripts load, "
        "and fails only when used"
    )


def placeholder(name: str, what: str, base: type = object) -> type:
    """A class named ``name`` whose construction fails with :func:`fail`."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        fail(name, what)

    short = name.rpartition(".")[2]
    return type(short, (base,), {"__init__": __init__, "__doc__": f"Not built yet: {what}."})


def function(name: str, what: str):
    """A function named ``name`` that fails with :func:`fail` when called."""

    def unbuilt(*args: Any, **kwargs: Any) -> NoReturn:
        fail(name, what)

    unbuilt.__name__ = unbuilt.__qualname__ = name.rpartition(".")[2]
    unbuilt.__doc__ = f"Not built yet: {what}."
    return unbuilt
