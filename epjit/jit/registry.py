"""The modules ``python -m epjit.jit --check`` builds, as the packages above the JIT layer register them.

This layer knows no kernel family and imports nothing above it, so it cannot list the kernels itself: a package
names, in the entry-point group ``epjit.jit.specs`` of its metadata, a function without arguments that returns a
:class:`KernelSet` (its specs and the configuration to build them with). Entry points rather than a call from above:
``python -m epjit.jit`` is the program a user and CI run, and another package adds its kernels to the check by
declaring one more entry, with no change here. pyproject.toml holds the group, so an installed wheel carries it.

A source checkout run from its folder or through PYTHONPATH has no installed metadata for its own entries, or
stale metadata (an editable install made before an entry was added): the same table is then read from the
checkout's pyproject.toml, beside the package this layer sits in.
"""

from __future__ import annotations

import dataclasses
import importlib.metadata
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

from .config import JitConfig
from .errors import JitError
from .spec import KernelSpec

GROUP = "epjit.jit.specs"


@dataclasses.dataclass(frozen=True)
class KernelSet:
    """The modules one package builds (in this order) and the configuration they are built with (where its
    sources are, the cache, the version)."""

    config: JitConfig
    specs: Sequence[KernelSpec]


def _installed_entries() -> dict[str, str]:
    return {ep.name: ep.value for ep in importlib.metadata.entry_points(group=GROUP)}


def _checkout_entries(pyproject: Path) -> dict[str, str]:
    """The group's table in a source checkout's pyproject.toml (none where there is no checkout, or no TOML reader:
    Python 3.10 has none in its standard library)."""
    if not pyproject.is_file() or sys.version_info < (3, 11):
        return {}
    import tomllib

    project = tomllib.loads(pyproject.read_text()).get("project", {})
    return dict(project.get("entry-points", {}).get(GROUP, {}))


def registered() -> dict[str, str]:
    """Entry name -> ``module:function`` of every registered kernel set, sorted by name; a checkout's own table
    wins over installed metadata of the same name (which may be stale)."""
    entries = _installed_entries()
    entries.update(_checkout_entries(Path(__file__).resolve().parents[2] / "pyproject.toml"))
    return dict(sorted(entries.items()))


def kernel_sets(entries: dict[str, str] | None = None) -> list[tuple[str, KernelSet]]:
    """Every registered kernel set, loaded: (entry name, set) in entry-name order."""
    entries = registered() if entries is None else entries
    if not entries:
        raise JitError(f"no kernels are registered in the entry-point group {GROUP!r}: install the package that "
                       "provides them (in a source checkout: pip install -e .)")
    out = []
    for name, value in entries.items():
        try:
            provider: Callable[[], KernelSet] = importlib.metadata.EntryPoint(name, value, GROUP).load()
            found = provider()
        except Exception as e:  # noqa: BLE001 - any failure to load a provider is reported with its entry
            raise JitError(f"the kernels registered as {name} = {value!r} (entry-point group {GROUP!r}) did not "
                           f"load: {type(e).__name__}: {e}") from e
        if not isinstance(found, KernelSet):
            raise JitError(f"{name} = {value!r} (entry-point group {GROUP!r}) returned {type(found).__name__}, "
                           "not a KernelSet")
        out.append((name, found))
    return out
