"""One exception hierarchy, and the rank tag every message carries.

Validation errors are plain ``ValueError``/``TypeError`` subclasses so callers can catch them the usual way; what
goes wrong on the GPU or between ranks is an ``EpjitError``.
"""

from __future__ import annotations

from .jit import errors as _jit

_rank: int | None = None


def set_rank(rank: int | None) -> None:
    """Set by ``epjit.init`` so that every later message says which rank raised it."""
    global _rank
    _rank = rank


def rank_tag() -> str:
    return "" if _rank is None else f" (rank {_rank})"


def with_rank(message: str) -> str:
    return message + rank_tag()


class EpjitError(RuntimeError):
    """Base of everything epjit raises that is not a plain argument error."""


class SetupError(EpjitError):
    """Ranks, GPUs, MPI, NVSHMEM or the launcher are not in a state epjit can work with."""


class CompileError(EpjitError, _jit.CompileError):
    """NVRTC or nvJitLink refused a kernel; the message carries the compiler log and the dumped source."""


class CollectiveError(EpjitError):
    """A host-side collective (allgather, bcast, barrier) failed: a peer died or disagreed."""


class EpjitTimeoutError(EpjitError):
    """A kernel spin-wait ran past ``EPJIT_TIMEOUT_S``; the message names the kernel, rank, peer and values."""


class ArgumentError(ValueError):
    """A bad argument caught before any kernel runs (message names the argument, the values and the rank)."""


class ArgumentTypeError(TypeError):
    """A wrong dtype, framework or device caught before any kernel runs."""
