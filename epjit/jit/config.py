"""What the JIT layer is told from above: where the kernel sources are, where the cache lives, and what keys it.

The JIT layer imports nothing else of epjit: the package that owns the kernels (``epjit.kernels``) builds a
:class:`JitConfig` from its settings and hands it to every compile and load.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class JitConfig:
    """source_dir: the folder a spec's SOURCE is relative to (also the first ``-I``); cache_dir: cubins go under
    ``cache_dir/<version>/<sm_XX>/``; version: the sources' release, part of the cache path and key; arch: compile
    for this arch instead of the device's; key_extra: settings that change generated code (part of the key)."""

    source_dir: Path
    cache_dir: Path
    version: str = "0"
    arch: str | None = None
    key_extra: tuple[tuple[str, str], ...] = ()
