"""The benchmark behind ``wtransfer bench``: weight transfer, measured side by side in one run.

A suite is a module with ``add_arguments(parser)`` and ``run(args) -> int``. The wheel ships the weight-sync suite;
the others live in the repository's ``benchmarks/`` (``python -m benchmarks SUITE``) and share this runner.
"""

SUITES: dict[str, str] = {"weights": "wtransfer._bench.weights"}
DEFAULT_SUITE = "weights"
