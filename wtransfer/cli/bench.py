"""``wtransfer bench [weights] ...``: the weight-sync benchmark (the main job)."""

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
        help="measure weight sync on this machine, side by side with the alternatives",
        description="Measure wtransfer against the alternatives, side by side in one run.",
        add_help=False,  # `wtransfer bench --help` is answered by the suite's own parser
    )
    # The suite has its own options: everything after `bench` is parsed by it.
    parser.set_defaults(func=run, accepts_extra=True)


def run(args: argparse.Namespace) -> int:
    return run_suite(list(args.extra))


OTHER_SUITES = "; the other suites run from a checkout: python -m benchmarks SUITE"


def run_suite(argv: list[str], suites: dict[str, str] = SUITES, default: str | None = DEFAULT_SUITE,
              prog: str = "wtransfer bench", elsewhere: str = OTHER_SUITES) -> int:
    """Parse ``argv`` (``[SUITE] options``) with the suite's own parser and run it (also ``python -m benchmarks``)."""
    suite = default
    if argv and not argv[0].startswith("-"):
        suite, argv = argv[0], argv[1:]
    if suite not in suites:
        print(f"error: unknown bench suite {suite!r}; choose from {', '.join(suites)}{elsewhere}", file=sys.stderr)
        return 2
    module = importlib.import_module(suites[suite])
    parser = argparse.ArgumentParser(
        prog=f"{prog} {suite}",
        description=module.__doc__,
        epilog=f"suites: {', '.join(suites)}; `{prog} SUITE --help` for each",
        formatter_class=_HelpFormatter,
    )
    module.add_arguments(parser)
    args = parser.parse_args(argv)
    args.command_line = shlex.join([*prog.split(), suite, *argv])  # what regenerates a --markdown block
    return int(module.run(args) or 0)
