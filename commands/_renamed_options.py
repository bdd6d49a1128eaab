"""Command options renamed since an earlier release: still taken, each with a one-line notice."""
from __future__ import annotations

import sys
from typing import Optional, Sequence


def renamed_options(args: Optional[Sequence[str]], renamed: dict[str, str], prog: str) -> list[str]:
    """``args`` (``sys.argv[1:]`` when None) with each old option of ``renamed`` (``{old: new}``)
    written as its new name, as ``--old`` or ``--old=value``; one line on stderr for each used."""
    args = list(sys.argv[1:] if args is None else args)
    for index, arg in enumerate(args):
        name, equals, value = arg.partition("=")
        if name in renamed:
            args[index] = renamed[name] + equals + value
            print(f"{prog}: {name} is {renamed[name]} since release 0.3", file=sys.stderr)
    return args
