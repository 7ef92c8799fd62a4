"""`python -m zero_py COMMAND ...`: the command-line tools.

Each command lives in its own module, which defines ``register(subparsers)``: it adds its
parser (with ``help=``) and sets ``func`` (a callable(args) -> exit status) as the default.
COMMANDS lists those modules in the order `--help` shows them; a module is imported only to
register, so a command's heavy imports belong inside its func.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from typing import List, Optional

COMMANDS: List[str] = [
    "zero_py.tools.estimate",
    "zero_py.tools.env",
    "zero_py.checkpoint.cli",
    "zero_py.tools.plot",
    "zero_py.tools.bench",
]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m zero_py",
        description="zero_py's tools. `python -m zero_py COMMAND --help` describes each.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    for name in COMMANDS:
        importlib.import_module(name).register(sub)
    return parser


def main(argv: Optional[List[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except OSError as exc:  # a path the user gave (not writable, missing): said, not traced
        print(f"python -m zero_py {args.command}: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
