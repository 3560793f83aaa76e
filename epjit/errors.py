"""One exception hierarchy, the rank tag every message carries, and the checks of number and flag arguments.

Validation errors are plain ``ValueError``/``TypeError`` subclasses so callers can catch them the usual way; what
goes wrong on the GPU or between ranks is an ``EpjitError``.
"""

from __future__ import annotations

import operator

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


def as_int(value: object) -> int | None:
    """``value`` as an int if it is an integer (Python, NumPy, or a 0-d integer array of NumPy or torch), else None.

    Not ``int(value)``: that would take "8" or 8.7 (or True) and quietly make a size of them."""
    if type(value) is int:
        return value
    # operator.index takes exactly the integers (no str, float or None); bools and 1-element arrays it would take too.
    if isinstance(value, bool) or "bool" in str(getattr(value, "dtype", "")) or getattr(value, "ndim", 0) != 0:
        return None
    try:
        return operator.index(value)  # type: ignore[arg-type]
    except TypeError:
        return None


def check_int(value: object, name: str, minimum: int | None = 0) -> int:
    """``value`` as an int, for the argument ``name``: ArgumentTypeError unless it is an integer (:func:`as_int`),
    ArgumentError if it is below ``minimum`` (None: no bound); the message names the argument and shows the value."""
    number = as_int(value)
    if number is None or (minimum is not None and number < minimum):
        bound = "" if minimum is None else f" >= {minimum}"
        error = ArgumentTypeError if number is None else ArgumentError
        raise error(with_rank(f"{name} must be an int{bound}, got {value!r}"))
    return number


def check_flag(value: object, name: str) -> bool:
    """``value`` as a bool, for the flag ``name``: True, False or a value equal to one (1, 0, NumPy's bools); else
    ArgumentTypeError (``bool("False")`` is True: a flag given as text would silently mean the opposite)."""
    if type(value) is bool:
        return value
    try:
        if value in (False, True):
            return bool(value)
    except (TypeError, ValueError, RuntimeError):
        pass  # an array of several values (NumPy raises ValueError, torch RuntimeError): neither
    raise ArgumentTypeError(with_rank(f"{name} must be True or False, got {value!r}"))
