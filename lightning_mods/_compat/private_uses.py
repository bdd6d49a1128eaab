"""The one table of every private attribute of another library the package reaches (Lightning,
jsonargparse, timm, torch, numpy), each reached only through a function of a module of
:mod:`lightning_mods._compat` that names it and the releases of its library the tests passed on.

A release that moves one breaks that module's tests, not a run in silence; ``tests`` check that
no module outside :mod:`lightning_mods._compat` imports a private name of another library.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable


@dataclass(frozen=True)
class PrivateUse:
    """``private`` (what is reached) of ``library``, tested on its releases ``tested_on``."""

    library: str
    private: str
    tested_on: tuple[str, ...]


# "<module>.<function>" of the function that reaches it -> what it reaches
PRIVATE_USES: dict[str, PrivateUse] = {}


def reaches(library: str, private: str, tested_on: tuple[str, ...]) -> Callable:
    """Record that the decorated function reaches ``library``'s ``private`` (tested on ``tested_on``)."""
    def record(function: Callable) -> Callable:
        PRIVATE_USES[f"{function.__module__}.{function.__name__}"] = PrivateUse(library, private, tested_on)
        return function
    return record
