"""The kernels of a program read from its own text: every ``extern "C" __global__`` function, its parameters with
their C types, and the line of the text each is declared on.

A program written by hand (rather than a template instantiated from a spec) has no spec to hold its arguments
against: the signature in the text is the spec. Only C linkage kernels are launchable by name (their symbol is
their name); a ``__global__`` template or C++-linkage kernel is refused with its line, since a launch could not
name it. Comments are blanked (line breaks kept) before reading, so line numbers stay the text's own.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from .errors import JitError

# C type of a parameter passed by value -> (struct code, what it holds). Pointers of any type are addresses ("Q").
# `long` is 64 bits on every platform CUDA runs kernels from (LP64 Linux).
SCALARS: dict[str, str] = {
    "bool": "?",
    "char": "b", "signed char": "b", "int8_t": "b",
    "unsigned char": "B", "uint8_t": "B",
    "short": "h", "short int": "h", "int16_t": "h",
    "unsigned short": "H", "unsigned short int": "H", "uint16_t": "H",
    "int": "i", "signed": "i", "signed int": "i", "int32_t": "i",
    "unsigned": "I", "unsigned int": "I", "uint32_t": "I",
    "long": "q", "long int": "q", "long long": "q", "long long int": "q", "int64_t": "q",
    "unsigned long": "Q", "unsigned long int": "Q", "unsigned long long": "Q", "unsigned long long int": "Q",
    "uint64_t": "Q", "size_t": "Q",
    "float": "f",
    "double": "d",
}
_QUALIFIERS = {"const", "volatile", "__restrict__", "__restrict", "restrict"}

_TOKENS = re.compile(r'"(?:\\.|[^"\\\n])*"|\'(?:\\.|[^\'\\\n])*\'|//[^\n]*|/\*.*?\*/', re.DOTALL)
_DIRECTIVE = re.compile(r"^[ \t]*#(?:[^\n]*\\\n)*[^\n]*", re.MULTILINE)  # with its backslash continuations
_GLOBAL = re.compile(r"\b__global__\b")
_EXTERN_C_BLOCK = re.compile(r'\bextern\s+"C"\s*\{')
_NAME_AND_PAREN = re.compile(r"(\w+)\s*\($")


class SignatureError(JitError):
    """A kernel of a program whose signature a launch cannot fill (a template, C++ linkage, a type passed by value
    that is not a number); the message names the program, the line and the parameter."""


@dataclass(frozen=True)
class Parameter:
    """One kernel parameter: its name, its C type as written (qualifiers dropped, ``T*`` for pointers), whether it
    is a pointer, the struct code of its value, and the line of the program it is declared on."""

    name: str
    ctype: str
    pointer: bool
    code: str
    line: int


@dataclass(frozen=True)
class KernelSignature:
    name: str
    parameters: tuple[Parameter, ...]
    line: int

    def __str__(self) -> str:
        return f'extern "C" __global__ void {self.name}({", ".join(f"{p.ctype} {p.name}" for p in self.parameters)})'


def blank_comments(text: str) -> str:
    """``text`` with every comment replaced by spaces (its line breaks kept); string literals are left alone."""
    def blank(m: re.Match[str]) -> str:
        token = m.group(0)
        return token if token[0] in "\"'" else re.sub(r"[^\n]", " ", token)

    return _TOKENS.sub(blank, text)


def _line(text: str, offset: int) -> int:
    return text.count("\n", 0, offset) + 1


def _extern_c_blocks(text: str) -> list[tuple[int, int]]:
    """(start, end) offsets of every ``extern "C" { ... }`` block."""
    spans = []
    for m in _EXTERN_C_BLOCK.finditer(text):
        depth, i = 1, m.end()
        while i < len(text) and depth:
            depth += {"{": 1, "}": -1}.get(text[i], 0)
            i += 1
        spans.append((m.start(), i))
    return spans


def _closing(text: str, start: int) -> int:
    """The offset of the ``)`` that closes the ``(`` at ``start``."""
    depth = 0
    for i in range(start, len(text)):
        depth += {"(": 1, ")": -1}.get(text[i], 0)
        if depth == 0:
            return i
    raise SignatureError(f"unbalanced parentheses from line {_line(text, start)}")


def _split_top_level(text: str, start: int, end: int) -> list[tuple[str, int]]:
    """The comma-separated pieces of text[start:end] outside (), <>, [] and {}, with each one's offset."""
    pieces, depth, begin = [], 0, start
    for i in range(start, end):
        c = text[i]
        if c in "(<[{":
            depth += 1
        elif c in ")>]}":
            depth -= 1
        elif c == "," and depth == 0:
            pieces.append((text[begin:i], begin))
            begin = i + 1
    pieces.append((text[begin:end], begin))
    return pieces


def _parameter(program: str, kernel: str, piece: str, offset: int, text: str) -> Parameter:
    declaration = piece.split("=", 1)[0]  # a default value plays no part in a launch
    m = re.search(r"(\w+)\s*$", declaration)
    line = _line(text, offset + (m.start(1) if m else len(piece) - len(piece.lstrip())))
    where = f"{program}:{line}: kernel {kernel}"
    if m is None or "&" in declaration or "[" in declaration or "<" in declaration:
        raise SignatureError(f"{where}: parameter {' '.join(piece.split())!r} cannot be passed by a launch "
                             "(pointers, numbers and bool can; a reference, an array or a template type cannot)")
    name = m.group(1)
    words = [w for w in re.findall(r"[\w:]+|\*", declaration[:m.start(1)]) if w not in _QUALIFIERS]
    stars = words.count("*")
    base = " ".join(w for w in words if w != "*")
    if stars:
        return Parameter(name, base + "*" * stars, True, "Q", line)
    if base not in SCALARS:
        raise SignatureError(f"{where}: parameter {name} has type {base!r}, which a launch cannot pass by value "
                             "(pass a pointer to it instead; numbers and bool pass by value)")
    return Parameter(name, base, False, SCALARS[base], line)


def parse_kernels(text: str, program: str = "<source>") -> dict[str, KernelSignature]:
    """Every ``extern "C" __global__`` function of ``text`` by name, in order of appearance (a declaration and its
    definition count once). ``program`` names the text in errors (a file's path, or ``<source>``)."""
    return _read_globals(text, program, launchable=True)


def parse_globals(text: str, program: str = "<source>") -> dict[str, KernelSignature]:
    """Every ``__global__`` function of ``text`` by name, templates and C++ linkage included: the kernels of a
    spec's source (launched through the spec's name expressions), read to hold an edited copy against its spec."""
    return _read_globals(text, program, launchable=False)


def _read_globals(text: str, program: str, launchable: bool) -> dict[str, KernelSignature]:
    """The ``__global__`` functions; ``launchable``: refuse those a launch by name cannot find (a template, C++
    linkage)."""
    # Comments and preprocessor lines (a macro may spell a kernel's declaration) are blanked, line breaks kept.
    text = _DIRECTIVE.sub(lambda m: re.sub(r"[^\n]", " ", m.group(0)), blank_comments(text))
    blocks = _extern_c_blocks(text)
    kernels: dict[str, KernelSignature] = {}
    for m in _GLOBAL.finditer(text):
        paren = text.find("(", m.end())
        while paren > 0 and text[:paren].rstrip().endswith("__launch_bounds__"):
            paren = text.find("(", _closing(text, paren))
        named = _NAME_AND_PAREN.search(text[m.end():paren + 1])
        line = _line(text, m.start())
        if paren < 0 or named is None:
            raise SignatureError(f"{program}:{line}: cannot read the __global__ function declared here")
        name = named.group(1)
        before = text[max(0, m.start() - 200):m.start()]
        if launchable:
            _check_launchable(program, line, name, before, any(a <= m.start() < b for a, b in blocks))
        close = _closing(text, paren)
        pieces = [(p, o) for p, o in _split_top_level(text, paren + 1, close) if p.strip() not in ("", "void")]
        parameters = tuple(_parameter(program, name, p, o, text) for p, o in pieces)
        names = [p.name for p in parameters]
        if len(set(names)) != len(names):
            raise SignatureError(f"{program}:{line}: kernel {name} names a parameter twice: {names}")
        kernels.setdefault(name, KernelSignature(name, parameters, line))
    return kernels


def _check_launchable(program: str, line: int, name: str, before: str, in_extern_c_block: bool) -> None:
    if re.search(r">\s*$", before) and re.search(r"\btemplate\s*<", before):
        raise SignatureError(f"{program}:{line}: kernel {name} is a template, which a launch cannot name: "
                             f'make it a __device__ template called by an extern "C" __global__ function')
    if not (re.search(r'\bextern\s+"C"\s*$', before) or in_extern_c_block):
        raise SignatureError(f'{program}:{line}: kernel {name} is not extern "C": a launch finds a kernel by '
                             f'its name, which C++ linkage mangles (declare it extern "C" __global__)')
