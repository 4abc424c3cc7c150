"""The ``wtransfer`` command: ``list``, ``show``, ``check`` and ``bench``. Each subcommand module has
``add_parser(subparsers)`` and sets ``func`` on its parser, which returns the exit status."""

from __future__ import annotations

import argparse
import importlib
import logging
import sys
from collections.abc import Sequence

from wtransfer.errors import InvalidComponentError

SUBCOMMANDS = ("wtransfer.cli.listing", "wtransfer.cli.show", "wtransfer.cli.check", "wtransfer.cli.bench")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="wtransfer",
        description="Weight-transfer engines, KV connectors, KV offloading specs and eviction policies, as plugins.",
    )
    parser.add_argument("-v", "--verbose", action="count", default=0, help="log more (-vv for debug)")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    subparsers.required = True
    for module in SUBCOMMANDS:
        importlib.import_module(module).add_parser(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if extra and not getattr(args, "accepts_extra", False):
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    args.extra = extra
    level = {0: logging.WARNING, 1: logging.INFO}.get(args.verbose, logging.DEBUG)
    logging.basicConfig(level=level, format="%(levelname)s %(name)s: %(message)s")
    try:
        return int(args.func(args) or 0)
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:  # e.g. `wtransfer list | head`
        sys.stderr.close()
        return 0
    except InvalidComponentError as exc:  # e.g. a broken entry point: say it, no traceback
        print(f"wtransfer: {exc}", file=sys.stderr)
        return 2
