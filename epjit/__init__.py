"""epjit: expert-parallel dispatch and combine for Mixture-of-Experts models.

Importing this package touches no GPU, MPI, NVSHMEM or compiler: all of that starts in :func:`epjit.init`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .errors import (
    ArgumentError,
    ArgumentTypeError,
    CollectiveError,
    CompileError,
    EpjitError,
    EpjitTimeoutError,
    SetupError,
)

__version__ = "0.1.0"

__all__ = [
    "ArgumentError",
    "ArgumentTypeError",
    "CollectiveError",
    "CompileError",
    "EpjitError",
    "EpjitTimeoutError",
    "Group",
    "SetupError",
    "__version__",
    "init",
]

if TYPE_CHECKING:
    from .group import Group, init


def __getattr__(name: str) -> Any:
    # Lazy: `import epjit` must stay free of mpi4py/CuPy imports; they load on first use.
    if name in ("init", "Group"):
        from . import group

        return getattr(group, name)
    raise AttributeError(f"module 'epjit' has no attribute {name!r}")
