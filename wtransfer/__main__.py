"""``python -m wtransfer`` is the ``wtransfer`` command."""

from wtransfer.cli import main

raise SystemExit(main())
