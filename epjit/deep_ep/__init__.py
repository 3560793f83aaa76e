"""DeepEP's V1 ("legacy") Python API on epjit's kernels: ``Buffer``, ``Config``, ``EventOverlap``, ``EventHandle``.

Code written for DeepEP (``from deep_ep import Buffer, Config``, ``from deep_ep.utils import EventOverlap``) runs on
epjit after one opt-in line, before that code imports DeepEP::

    import epjit.deep_ep
    epjit.deep_ep.install()   # deep_ep and deep_ep.utils are now these modules

What maps to what, and every difference from DeepEP with its reason: docs/deep_ep.md. Importing this package
imports neither torch nor CuPy; the calls need torch tensors, as DeepEP's do.
"""

from __future__ import annotations

import sys
from typing import Any

from ..errors import SetupError, with_rank
from . import utils
from .buffer import Buffer, LowLatencyHandle, set_num_nvl_ranks
from .config import Config
from .handles import NormalHandle
from .utils import EventHandle, EventOverlap

# The module names DeepEP's users import, and what install() makes each of them.
ALIASES = {"deep_ep": __name__, "deep_ep.utils": utils.__name__}


def install(num_nvl_ranks: int | None = None) -> None:
    """Make ``import deep_ep`` and ``import deep_ep.utils`` give epjit's modules (sys.modules entries). Refuses,
    changing nothing, where a real DeepEP is already imported: its objects would be mixed with these.
    ``num_nvl_ranks``: the NVLink node size of the epjit group a Buffer makes from its torch group or communicator
    (``epjit.init``'s argument; None, the default: the ranks of a host), e.g. 2 to run 4 ranks of one host as two
    virtual nodes."""
    for alias, target in ALIASES.items():
        found = sys.modules.get(alias)
        if found is not None and found is not sys.modules[target]:
            where = getattr(found, "__file__", None) or repr(found)
            raise SetupError(with_rank(
                f"a module {alias!r} is already imported ({where}): epjit.deep_ep.install() must run before "
                "anything imports DeepEP, in a process that is to use epjit in its place"))
    set_num_nvl_ranks(num_nvl_ranks)
    for alias, target in ALIASES.items():
        sys.modules[alias] = sys.modules[target]


def uninstall() -> None:
    """Undo :func:`install` (the aliases, and its num_nvl_ranks; a module that imported ``deep_ep`` keeps what it
    got)."""
    set_num_nvl_ranks(None)
    for alias, target in ALIASES.items():
        if sys.modules.get(alias) is sys.modules[target]:
            del sys.modules[alias]


def installed() -> bool:
    """Whether ``deep_ep`` is this package now."""
    return sys.modules.get("deep_ep") is sys.modules[__name__]


def __getattr__(name: str) -> Any:
    if name == "topk_idx_t":  # DeepEP's dtype of topk_idx; torch only when asked for
        import torch

        return torch.int64
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["Buffer", "Config", "EventHandle", "EventOverlap", "LowLatencyHandle", "NormalHandle", "install",
           "installed", "uninstall", "utils"]
