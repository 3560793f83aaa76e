"""A variant of a built-in kernel family (epjit.lab.variant) beside the built-in kernels: one call run both ways on
one Buffer, each result checked (against epjit.reference, say), each timed as the benchmark times the low-latency
rows (CUDA-graph replays, every rank starting together: docs/benchmark.md)."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any

from ..lab import Variant, use_variant
from .protocol import graph_us


@dataclass(frozen=True)
class Comparison:
    """One call run with a variant and with the built-in kernels: each one's median (CUDA-graph replays, this
    rank's figure, docs/benchmark.md's protocol) and what its check found wrong (nothing: it matched)."""

    variant: str
    variant_us: float
    built_in_us: float
    variant_problems: tuple[str, ...]
    built_in_problems: tuple[str, ...]
    repeat: int

    @property
    def matches(self) -> bool:
        return not self.variant_problems and not self.built_in_problems

    def __str__(self) -> str:
        verdict = "both match the reference" if self.matches else "; ".join(
            f"{who}: {', '.join(p)}" for who, p in (("variant", self.variant_problems),
                                                   ("built-in", self.built_in_problems)) if p)
        return (f"variant {self.variant}: {self.variant_us:.1f} us, built-in {self.built_in_us:.1f} us "
                f"(median of {self.repeat} CUDA-graph replays, this rank); {verdict}")


def compare(buffer: Any, variant: Variant, call: Callable[[], Any], check: Callable[[Any], Iterable[str]], *,
            repeat: int = 20) -> Comparison:
    """Collective (every rank at once): ``call()`` (one low-latency call on ``buffer``, returning its result) with
    ``variant`` and with the built-in kernels; ``check(result)`` lists what differs from the reference (e.g.
    epjit.lab.dispatch_problems); each timed as the benchmark times the low-latency rows (graph_us). Needs torch and
    the benchmark's NCCL group (init_with_nccl), as the benchmark does."""
    figures = {}
    for who, context in (("variant", use_variant(buffer, variant)), ("built-in", nullcontext())):
        with context:
            problems = tuple(check(call()))
            figures[who] = (graph_us(call, buffer.group, repeat), problems)
    return Comparison(variant.name, figures["variant"][0], figures["built-in"][0], figures["variant"][1],
                      figures["built-in"][1], repeat)
