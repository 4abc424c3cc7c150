"""Benchmarks behind ``wtransfer bench [SUITE]``: each prints figures and ratios measured side by side.

A suite is a module here with ``add_arguments(parser)`` and ``run(args) -> int``;
``SUITES`` maps the suite name to its module (the first one is the default).
"""

SUITES: dict[str, str] = {
    "weights": "wtransfer.bench.weights",
    "discovery": "wtransfer.bench.discovery",
    "storage": "wtransfer.bench.storage",
    "offload": "wtransfer.bench.offload",
    "sharded": "wtransfer.bench.sharded",
}
DEFAULT_SUITE = "weights"
