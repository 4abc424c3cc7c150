"""Benchmarks behind ``wtransfer bench [SUITE]``: each prints figures and ratios measured side by side.

A suite is a module here with ``add_arguments(parser)`` and ``run(args) -> int``;
``SUITES`` maps the suite name to its module (the first one is the default).
"""

SUITES: dict[str, str] = {
    "weights": "wtransfer._bench.weights",
    "discovery": "wtransfer._bench.discovery",
    "storage": "wtransfer._bench.storage",
    "offload": "wtransfer._bench.offload",
    "sharded": "wtransfer._bench.sharded",
    "delta": "wtransfer._bench.delta",
}
DEFAULT_SUITE = "weights"
