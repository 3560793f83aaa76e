"""epjit: expert-parallel dispatch and combine for Mixture-of-Experts models.

Importing this package touches no GPU, MPI, NVSHMEM or compiler: all of that starts in :func:`epjit.init`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ._version import __version__
from .errors import (
    ArgumentError,
    ArgumentTypeError,
    CollectiveError,
    CompileError,
    EpjitError,
    EpjitTimeoutError,
    SetupError,
)

__all__ = [
    "ArgumentError",
    "ArgumentTypeError",
    "CollectiveError",
    "CompileError",
    "EpjitError",
    "EpjitTimeoutError",
    "Buffer",
    "CombineResult",
    "Config",
    "DispatchHandle",
    "DispatchLayout",
    "DispatchResult",
    "Event",
    "Group",
    "SetupError",
    "__version__",
    "init",
]

if TYPE_CHECKING:
    from .buffer import Buffer, CombineResult, DispatchHandle, DispatchLayout, DispatchResult, Event
    from .config import Config
    from .group import Group, init

_LAZY = {
    "init": "group", "Group": "group", "Config": "config", "Buffer": "buffer", "CombineResult": "buffer",
    "DispatchHandle": "buffer", "DispatchLayout": "buffer", "DispatchResult": "buffer", "Event": "buffer",
}


def __getattr__(name: str) -> Any:
    # Lazy: `import epjit` must stay free of mpi4py/CuPy imports; they load on first use.
    if name in ("autograd", "lab"):  # torch users' module (imports torch) and the kernel lab: only when asked for
        import importlib

        return importlib.import_module(f".{name}", __name__)
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'epjit' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(f".{module}", __name__), name)
