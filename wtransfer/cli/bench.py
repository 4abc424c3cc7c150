"""``wtransfer bench [SUITE] ...``: the benchmarks; without a suite, weight transfer (the main job)."""

from __future__ import annotations

import argparse
import importlib
import shlex
import sys

from wtransfer._bench import DEFAULT_SUITE, SUITES


class _HelpFormatter(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    """The suite's docstring as written, and every option's default shown by argparse itself."""


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "bench",
        help=f"run a benchmark (suites: {', '.join(SUITES)}; default {DEFAULT_SUITE})",
        description="Measure wtransfer against the alternatives, side by side in one run.",
        add_help=False,  # `wtransfer bench [SUITE] --help` is answered by the suite's own parser
    )
    # Suites have their own options: everything after `bench` is parsed by the chosen suite.
    parser.set_defaults(func=run, accepts_extra=True)


def run(args: argparse.Namespace) -> int:
    return run_suite(list(args.extra))


def run_suite(argv: list[str]) -> int:
    suite = DEFAULT_SUITE
    if argv and not argv[0].startswith("-"):
        suite, argv = argv[0], argv[1:]
    if suite not in SUITES:
        print(f"error: unknown bench suite {suite!r}; choose from {', '.join(SUITES)}", file=sys.stderr)
        return 2
    module = importlib.import_module(SUITES[suite])
    parser = argparse.ArgumentParser(
        prog=f"wtransfer bench {suite}",
        description=module.__doc__,
        epilog=f"suites: {', '.join(SUITES)} (default {DEFAULT_SUITE}); `wtransfer bench SUITE --help` for each",
        formatter_class=_HelpFormatter,
    )
    module.add_arguments(parser)
    args = parser.parse_args(argv)
    args.command_line = shlex.join(["wtransfer", "bench", suite, *argv])  # what regenerates a --markdown block
    return int(module.run(args) or 0)
