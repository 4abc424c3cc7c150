"""``--json`` for the suites that print tables: the same figures, one JSON document on stdout.

A suite prints its human-readable lines as it measures; with ``--json`` those lines go to
stderr (progress) and the figures it recorded in the dict go to stdout as one document.
"""

from __future__ import annotations

import contextlib
import json
import sys
from collections.abc import Iterator
from typing import Any


@contextlib.contextmanager
def json_report(enabled: bool) -> Iterator[dict[str, Any]]:
    figures: dict[str, Any] = {}
    if not enabled:
        yield figures
        return
    with contextlib.redirect_stdout(sys.stderr):
        yield figures
    print(json.dumps(figures, indent=2))
