"""wtransfer's benchmarks beyond ``wtransfer bench``, run from a checkout: ``python -m benchmarks SUITE``.

They are not part of the installed package: each measures one mechanism (sharded trainers, delta
rounds, the KV store, offloading, component discovery) against its alternatives, side by side in
one run, and writes its figures to BENCHMARKS.md with ``--markdown BENCHMARKS.md``.
"""

SUITES: dict[str, str] = {
    "discovery": "benchmarks.discovery",
    "storage": "benchmarks.storage",
    "offload": "benchmarks.offload",
    "sharded": "benchmarks.sharded",
    "delta": "benchmarks.delta",
}
