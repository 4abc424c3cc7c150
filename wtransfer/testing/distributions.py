"""Write real installed-distribution folders (``.dist-info``) for discovery tests: ``importlib.metadata`` finds
them like any pip-installed package once their parent is on ``sys.path`` (or ``PYTHONPATH``), so no mocking."""

from __future__ import annotations

import contextlib
import importlib
import re
import sys
import textwrap
from collections.abc import Iterator, Mapping
from pathlib import Path

EntryPoints = Mapping[str, Mapping[str, str]]  # group -> {name: "module:Class"}


@contextlib.contextmanager
def site_on_path(site_dir: str | Path) -> Iterator[Path]:
    """Put ``site_dir`` first on ``sys.path`` (rescanning components) for the block; afterwards remove it, forget
    every module imported from it, and rescan again."""
    from wtransfer._registry.registry import refresh

    site = str(site_dir)
    sys.path.insert(0, site)
    importlib.invalidate_caches()
    refresh()
    try:
        yield Path(site_dir)
    finally:
        sys.path.remove(site)
        for module_name, module in list(sys.modules.items()):
            if (getattr(module, "__file__", None) or "").startswith(site):
                del sys.modules[module_name]
        importlib.invalidate_caches()
        refresh()


def is_installed(name: str) -> bool:
    """Whether a distribution of that name is installed in this environment."""
    from importlib.metadata import PackageNotFoundError, distribution

    try:
        distribution(name)
    except PackageNotFoundError:
        return False
    return True


def write_distribution(
    site_dir: str | Path,
    name: str,
    version: str = "1.0",
    entry_points: EntryPoints | None = None,
    modules: Mapping[str, str] | None = None,
) -> Path:
    """Create ``<site_dir>/<name>-<version>.dist-info`` plus source modules; return the dist-info path.

    ``modules`` maps a dotted module name to its source (dedented; packages get ``__init__.py`` as needed)."""
    site = Path(site_dir)
    site.mkdir(parents=True, exist_ok=True)
    stem = re.sub(r"[-_.]+", "_", name)
    info = site / f"{stem}-{version}.dist-info"
    info.mkdir(exist_ok=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
    lines: list[str] = []
    for group, items in (entry_points or {}).items():
        lines.append(f"[{group}]")
        lines.extend(f"{ep_name} = {value}" for ep_name, value in items.items())
        lines.append("")
    (info / "entry_points.txt").write_text("\n".join(lines))
    written = [f"{info.name}/METADATA", f"{info.name}/entry_points.txt", f"{info.name}/RECORD"]
    for dotted, source in (modules or {}).items():
        parts = dotted.split(".")
        for depth in range(1, len(parts)):
            package = site.joinpath(*parts[:depth])
            package.mkdir(exist_ok=True)
            init = package / "__init__.py"
            if not init.exists():
                init.write_text("")
        path = site.joinpath(*parts[:-1], f"{parts[-1]}.py")
        path.write_text(textwrap.dedent(source))
        written.append(str(path.relative_to(site)))
    (info / "RECORD").write_text("".join(f"{w},,\n" for w in written))
    return info
