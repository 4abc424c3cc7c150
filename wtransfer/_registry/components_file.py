"""Components declared in TOML files that ``WTRANSFER_COMPONENTS`` names: no packaging needed.

Entry points need a pip-installed distribution. A team trying a backend from a checkout, a
notebook or a monorepo can instead list its components in a file and point the variable at
it (several files: separated by ``os.pathsep``)::

    # team-backends.toml
    distribution = "team"              # qualifies the names (team:fast-shm); default: the file's stem
    [engines]
    fast-shm = "team_backends.engines:FastShmEngine"
    [connectors]
    lab-store = "team_backends.kv:LabStoreConnector"

Unlike ``WeightTransferEngineFactory.register_engine()``, which only the calling process
sees, an environment variable is inherited by every process a job starts (spawned workers,
vLLM's engine core and workers), so the component resolves everywhere. Classes are imported
on first use, as entry points are; ``WTRANSFER_DISABLE_PLUGINS`` disables them the same way
(by the file's ``distribution`` or by ``kind:name``). A file that is missing or malformed
is an error on the first lookup: the user asked for it, so it is never skipped silently.
"""

from __future__ import annotations

import os
from pathlib import Path

from wtransfer._registry.component import ComponentRef
from wtransfer._registry.hooks import hookimpl
from wtransfer._registry.kinds import KINDS, resolve_kind
from wtransfer._registry.names import normalize_distribution
from wtransfer.errors import InvalidComponentError

COMPONENTS_ENV = "WTRANSFER_COMPONENTS"
ORIGIN = "components file"


def _toml(path: Path) -> dict:
    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10
        try:
            import tomli as tomllib  # type: ignore[no-redef]
        except ModuleNotFoundError:
            raise InvalidComponentError(
                f"{COMPONENTS_ENV} names {path}, and reading TOML on Python 3.10 needs tomli: pip install tomli"
            ) from None
    try:
        with open(path, "rb") as handle:
            return tomllib.load(handle)
    except FileNotFoundError:
        raise InvalidComponentError(
            f"{COMPONENTS_ENV} names {path}, which does not exist; fix the path or unset {COMPONENTS_ENV}"
        ) from None
    except (OSError, ValueError) as exc:  # tomllib.TOMLDecodeError is a ValueError
        raise InvalidComponentError(f"{COMPONENTS_ENV}: cannot read {path}: {exc}") from None


def read_components_file(path: Path) -> list[ComponentRef]:
    """Every component one file declares, checked (kinds, names, ``module:Class`` targets)."""
    data = _toml(path)
    distribution = data.get("distribution", path.stem)
    unknown = sorted(key for key in data if key != "distribution" and not _is_kind(key))
    if not isinstance(distribution, str) or not distribution or ":" in distribution:
        raise InvalidComponentError(f"{path}: 'distribution' must be a name without ':', got {distribution!r}")
    if normalize_distribution(distribution) in _installed_distributions():
        given = "distribution" in data
        raise InvalidComponentError(  # its qualified names would be ambiguous with no way out
            f"{path}: distribution = {distribution!r}{'' if given else ' (by default, the file name stem)'} is "
            f"the name of an installed distribution providing wtransfer components; set `distribution` "
            f"to a name of your own, so that {distribution}:NAME says which one is meant"
        )
    if unknown:
        raise InvalidComponentError(
            f"{path}: unknown table(s) {', '.join(map(repr, unknown))}; a components file has 'distribution' "
            f"and tables named after kinds: {', '.join(KINDS)}"
        )
    refs = []
    for key, table in data.items():
        if key == "distribution":
            continue
        kind = resolve_kind(key).name
        if not isinstance(table, dict):
            raise InvalidComponentError(f"{path}: [{key}] must be a table of name = \"module:Class\" lines")
        for name, target in table.items():
            module, sep, attribute = target.partition(":") if isinstance(target, str) else ("", "", "")
            if not (sep and module and attribute) or ":" in name or not name:
                raise InvalidComponentError(
                    f"{path}: [{key}] {name} = {target!r}: write name = \"package.module:Class\" (a name without ':')"
                )
            refs.append(ComponentRef(kind, name, target, distribution, None, origin=f"{ORIGIN} {path}"))
    return refs


def _is_kind(key: str) -> bool:
    try:
        resolve_kind(key)
    except ValueError:
        return False
    return True


def _installed_distributions() -> set[str]:
    from wtransfer._registry import discovery

    return {normalize_distribution(record.distribution) for record in discovery.cached_scan()}


def components_files() -> list[Path]:
    """The files ``WTRANSFER_COMPONENTS`` names, in order (none when it is unset or empty).

    Paths must be absolute: every process reads the variable from its own working directory
    (a Ray actor, a vLLM worker), where a relative path would name another file or none.
    """
    try:
        items = (item.strip() for item in os.environ.get(COMPONENTS_ENV, "").split(os.pathsep))
        paths = [Path(item).expanduser() for item in items if item]
    except RuntimeError as exc:  # ~user that does not exist
        raise InvalidComponentError(f"{COMPONENTS_ENV}: {exc}") from None
    relative = [str(path) for path in paths if not path.is_absolute()]
    if relative:
        raise InvalidComponentError(
            f"{COMPONENTS_ENV} names {', '.join(relative)}: give absolute paths, as every process reads "
            f"it from its own working directory (e.g. {Path(relative[0]).resolve()})"
        )
    return paths


class ComponentsFiles:
    """Built-in hook implementation: the second contributor of ``wtransfer_components``."""

    @hookimpl
    def wtransfer_components(self, kind: str) -> list[ComponentRef]:
        wanted = resolve_kind(kind).name
        return [ref for path in components_files() for ref in read_components_file(path) if ref.kind == wanted]
