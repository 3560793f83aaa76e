"""Variants of the built-in kernels for the kernel lab (epjit.lab.variant, use_variant).

A variant is a family's own source edited (a text replaced, a define added, or a whole edited copy of the file),
compiled with the family's spec in place of the built-in source: the spec's name expressions, defines and NVSHMEM
link, a cache entry of its own. Its kernels must take the built-in spec's arguments (names, order, C types),
checked from its text before anything compiles, because a Buffer launches it with the arguments its plans packed
for the built-in kernels. ``use_variant`` swaps the module a Buffer's low-latency calls launch for the variant's and
restores it after; ``dispatch_problems`` and ``combine_problems`` hold a call's result against epjit.reference
(epjit.bench.variant times a variant beside the built-in kernels with the benchmark's protocol).
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np

from .. import jit, memory
from ..errors import ArgumentError, CompileError, SetupError, with_rank
from ..jit.program import Program, compile_variant
from ..jit.signature import KernelSignature, SignatureError, parse_globals
from ..kernels import LowLatencyPutsSpec, LowLatencySpec, LowLatencyStoresSpec, cuda_sources, jit_config

# family -> its builds (spec classes over one source): a variant is compiled for the build the Buffer runs.
FAMILIES: dict[str, tuple[type[jit.KernelSpec], ...]] = {
    "low_latency": (LowLatencySpec, LowLatencyPutsSpec, LowLatencyStoresSpec),
}
_QUALIFIERS = {"const", "volatile", "__restrict__", "__restrict", "restrict"}


class Variant:
    """A family's source, edited, for the family's builds. ``text`` is the edited source (NVRTC's program, named
    ``program_name`` in its log), ``defines`` what it is compiled with beyond the build's own, ``replaced`` how often
    each replaced text occurred. Compiled per build and arch on demand (``compiled``), loaded per GPU
    (``module``)."""

    def __init__(self, family: str, name: str, program: Program, replaced: dict[str, int], arch: str) -> None:
        self.family, self.name, self.program, self.replaced, self.arch = family, name, program, replaced, arch
        self.text, self.program_name, self.defines = program.text, program.name, program.defines
        self.kernels = parse_globals(program.text, program.name)
        self._compiled: dict[tuple[jit.KernelSpec, str], jit.CompiledModule] = {}
        self._modules: dict[tuple[jit.KernelSpec, int], jit.Module] = {}

    def __repr__(self) -> str:
        return (f"<epjit.lab.Variant {self.name} of {self.family}: {len(self.replaced)} replacement(s), "
                f"defines {list(self.defines)}>")

    def check(self, spec: jit.KernelSpec) -> None:
        """Refuse (ArgumentError) a text whose kernels do not take ``spec``'s arguments, naming what differs."""
        problems = signature_problems(spec, self.kernels, self.program_name)
        if problems:
            raise ArgumentError(with_rank(f"variant {self.name} cannot run in place of {type(spec).__name__}'s "
                                          "kernels: " + "; ".join(problems)))

    def compiled(self, spec: jit.KernelSpec | None = None, arch: str | None = None) -> jit.CompiledModule:
        """The cubin of this variant for ``spec`` (default: the family's first build) and ``arch`` (default: the
        variant's): from the cache, else compiled now. Raises CompileError with the edited text's lines."""
        spec = spec if spec is not None else FAMILIES[self.family][0]()
        arch = jit.normalize_arch(arch or self.arch)
        found = self._compiled.get((spec, arch))
        if found is None:
            self.check(spec)
            try:
                found = compile_variant(self.program, spec, arch, jit_config())
            except jit.CompileError as e:
                raise CompileError(with_rank(str(e))) from e
            except jit.JitError as e:
                raise SetupError(with_rank(str(e))) from e
            self._compiled[(spec, arch)] = found
        return found

    def module(self, spec: jit.KernelSpec, device: int) -> jit.Module:
        """The variant for ``spec`` loaded on GPU ``device`` (compiled for its arch first, where needed)."""
        found = self._modules.get((spec, device))
        if found is None:
            compiled = self.compiled(spec, jit.device_arch(device, jit_config().arch))
            found = self._modules[(spec, device)] = load_module(compiled, device)
        return found


def make_variant(family: str, source: tuple[str, str, tuple[Path, ...]] | None, replace: Mapping[str, str],
                 defines: tuple[str, ...], name: str | None, arch: str) -> Variant:
    """The Variant behind epjit.lab.variant: ``source`` (text, NVRTC's name for it, its own include folders), or
    None for the family's own file; then ``replace`` applied in order, each text refused if it does not occur."""
    builds = FAMILIES.get(family)
    if builds is None:
        raise ArgumentError(with_rank(f"no family {family!r} has variants; the families: {sorted(FAMILIES)}"))
    name = name or family
    if not re.fullmatch(r"[\w.-]+", name):
        raise ArgumentError(with_rank(f"variant name {name!r} must be letters, digits, '_', '.' or '-'"))
    source_file = builds[0].SOURCE
    if source is None:
        source = ((cuda_sources() / source_file).read_text(), f"<variant {name} of {source_file}>", ())
    text, program_name, include_dirs = source
    replaced: dict[str, int] = {}
    for old, new in replace.items():
        if not isinstance(old, str) or not isinstance(new, str) or not old:
            raise ArgumentError(with_rank(f"replace maps a text to its replacement, got {old!r}: {new!r}"))
        count = text.count(old)
        if count == 0:
            raise ArgumentError(with_rank(f"replace: {old!r} does not occur in {source_file}"
                                          f"{'' if program_name.startswith('<') else f' ({program_name})'}"
                                          f"{_nearest_line(text, old)}"))
        text, replaced[old] = text.replace(old, new), count
    program = Program(text, program_name, f"variant.{name}", defines, include_dirs)
    try:
        return Variant(family, name, program, replaced, arch)
    except SignatureError as e:
        raise CompileError(with_rank(str(e))) from e


def _nearest_line(text: str, old: str) -> str:
    """Where the replaced text's first line does occur, if it does: most misses are a changed remainder."""
    first = old.strip().splitlines()[0].strip() if old.strip() else ""
    for number, line in enumerate(text.splitlines(), 1):
        if first and first in line:
            return f"; its first line is at line {number}: {line.strip()!r}"
    return ""


def normal_ctype(ctype: str, namespace: str) -> str:
    """A C type as the signatures compare it: qualifiers and the spec's namespace dropped, ``T*`` for pointers."""
    words = [w.removeprefix(f"{namespace}::") for w in re.findall(r"[\w:]+|\*", ctype) if w not in _QUALIFIERS]
    return " ".join(w for w in words if w != "*") + "*" * words.count("*")


def signature_problems(spec: jit.KernelSpec, kernels: Mapping[str, KernelSignature], program: str) -> list[str]:
    """Where the text's kernels do not take ``spec``'s arguments: a kernel missing, a parameter renamed, moved,
    retyped, added or dropped (the first difference of each kernel, with its line)."""
    problems = []
    for kernel, declared in spec.KERNELS.items():
        found = kernels.get(kernel)
        if found is None:
            problems.append(f"{program} has no __global__ function {kernel}")
            continue
        want = [(n, normal_ctype(c, spec.NAMESPACE)) for n, c in declared]
        got = [(p.name, normal_ctype(p.ctype, spec.NAMESPACE)) for p in found.parameters]
        for i, (w, g) in enumerate(zip(want, got, strict=False)):
            if w != g:
                problems.append(f"{program}:{found.parameters[i].line}: {kernel}'s parameter {i + 1} is "
                                f"'{g[1]} {g[0]}', the built-in's is '{w[1]} {w[0]}'")
                break
        else:
            if len(got) != len(want):
                extra = [f"'{c} {n}'" for n, c in (got[len(want):] or want[len(got):])]
                problems.append(f"{program}:{found.line}: {kernel} takes {len(got)} parameters, the built-in "
                                f"{len(want)} ({'added' if len(got) > len(want) else 'missing'}: {', '.join(extra)})")
    return problems


def load_module(compiled: jit.CompiledModule, device: int) -> jit.Module:
    """A variant's cubin loaded on ``device`` as a module of its spec (launched with the spec's packed arguments);
    one linked with NVSHMEM is finalised before NVSHMEM is."""
    import cupy

    try:
        with cupy.cuda.Device(device):
            module = jit.Module(compiled, device)
    except jit.JitError as e:
        raise CompileError(with_rank(str(e))) from e
    if compiled.spec.USES_NVSHMEM:
        memory.before_nvshmem_finalize(module.close)
    return module


def low_latency_ops(buffer: Any) -> Any:
    """The low-latency family's ops of ``buffer`` (what holds the module its calls launch)."""
    ops = getattr(getattr(buffer, "_low_latency", None), "ops", None)
    if ops is None:
        raise ArgumentError(with_rank("this Buffer runs no low-latency kernels (made with low_latency_mode=False, "
                                      "or closed): a low_latency variant runs in place of them"))
    return ops


def _pending(ops: Any) -> list[str]:
    return [call for call in ops.pending if call is not None]


@contextmanager
def use_variant(buffer: Any, variant: Variant) -> Iterator[jit.Module]:
    """Inside the ``with``, ``buffer``'s low-latency calls launch ``variant``'s kernels (compiled for the build the
    Buffer runs and for its GPU, and loaded, on entry); on exit the built-in module is back. Refused while a
    receive hook is pending, on entry (its receive half would be the variant's) and on exit (the built-in's)."""
    if variant.family != "low_latency":
        raise ArgumentError(with_rank(f"use_variant runs a low_latency variant, not one of {variant.family}"))
    ops = low_latency_ops(buffer)
    built_in = ops.module
    if _pending(ops):
        raise ArgumentError(with_rank(f"use_variant: the receive hook of {_pending(ops)[0]} has not run: call it "
                                      "first (its send half ran the built-in kernels)"))
    ops.module = variant.module(built_in.spec, ops.device)
    try:
        yield ops.module
    finally:
        ops.module = built_in
    if _pending(ops):
        raise ArgumentError(with_rank(f"use_variant: the receive hook of {_pending(ops)[0]} has not run inside the "
                                      "with: it would run the built-in's receive half after the variant's send"))


def dispatch_problems(result: Any, want: Any) -> list[str]:
    """What a low-latency dispatch's ``result`` has that ``want`` (this rank's record of
    epjit.reference.low_latency_dispatch) has not, bit for bit: recv_count, layout_range, then each local expert's
    received rows, their sources and scales (rows past recv_count are not compared)."""
    count = _host(result.recv_count).astype(np.int64)
    problems = [f"{name} differs" for name, got, ref in (
        ("recv_count", result.recv_count, want.recv_count),
        ("layout_range", result.handle.layout_range, want.handle.layout_range)) if not _same(got, ref)]
    if problems:
        return problems
    pairs = [("x", result.x, want.x), ("src_info", result.handle.src_info, want.src_info)]
    if want.x_scales is not None:
        pairs.append(("x_scales", result.x_scales, want.x_scales))
    for name, got, ref in pairs:
        got_host, ref_host = _host(got), _host(ref)
        problems += [f"{name}[{e}] differs" for e, n in enumerate(count.tolist())
                     if not _same(got_host[e, :n], ref_host[e, :n])]
    return problems


def combine_problems(result: Any, want: Any) -> list[str]:
    """What a low-latency combine's ``result`` has that ``want`` (this rank's record of
    epjit.reference.low_latency_combine, summed in k order as the kernels sum) has not, bit for bit."""
    return [] if _same(result.x, want.x) else ["combined x differs"]


def _host(value: Any) -> np.ndarray:
    from ..reference._checks import host_array

    return host_array(value)


def _same(got: Any, ref: Any) -> bool:
    """Bit for bit (bf16 and FP8 compared as their bytes: NaN rows equal themselves)."""
    a, b = np.ascontiguousarray(_host(got)), np.ascontiguousarray(_host(ref))
    return a.shape == b.shape and a.dtype.itemsize == b.dtype.itemsize and bool(
        np.array_equal(a.view(np.uint8), b.view(np.uint8)))
