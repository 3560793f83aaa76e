"""Comments point at homes that exist: every repository file a comment or docstring in epjit/, cuda_src/, scripts/
and tests/ names is there, and a symbol named in a form that can only mean one thing resolves: a dotted name
from epjit, ``Class.member`` of a class of this repository, a Python file's path followed by a colon and a name
that reads as code. A module split or a file renamed fails here
until the comments that send a reader to the old home are fixed."""

from __future__ import annotations

import ast
import io
import os
import re
import tokenize
from collections.abc import Iterator
from functools import cache
from pathlib import Path

from epjit.jit.registry import GROUP

ROOT = Path(__file__).resolve().parents[1]
SCANNED = ("epjit", "cuda_src", "scripts", "tests")
SKIPPED_DIRS = {"__pycache__", "build", "dist", "node_modules"}
# Names that stand for a file of the user's, or of a format, not one of this repository.
NOT_OURS = {"script.py", "out.json", "entry_points.txt",
            "page.md", "xN-what.json", "-2.json"}  # the last three: patterns test_docs_and_tools.py describes
# Dotted names that look like modules but are not: the JIT layer's entry-point group.
NOT_MODULES = {GROUP}

_PATH = re.compile(r"(?<![\w/.-])((?:[\w.-]+/)*[\w-]+(?:\.[\w-]+)*\.(?:py|cu|cuh|sh|md|toml|json|ipynb))\b")
_DOTTED = re.compile(r"(?<![\w.])epjit(?:\.\w+)+")
_CLASS_MEMBER = re.compile(r"(?<![\w.])(_*[A-Z][a-z]\w*)\.(_*[a-z_]\w*)\b(?!\.\w)")
# A Python file's path, a colon and a name that reads as code (an underscore, a dot or a capital), not a prose
# word after a colon.
_FILE_SYMBOL = re.compile(r"\b((?:[\w-]+/)*[\w-]+\.py): `{0,2}(\w*[_.A-Z][\w.]*)")


def _walk(top: Path) -> Iterator[Path]:
    for folder, dirs, files in os.walk(top):
        dirs[:] = [d for d in dirs if not d.startswith(".") and d not in SKIPPED_DIRS and not d.endswith(".egg-info")]
        yield from (Path(folder) / f for f in files)


@cache
def _repository_files() -> frozenset[Path]:
    return frozenset(p.relative_to(ROOT) for p in _walk(ROOT))


@cache
def _file_names() -> frozenset[str]:
    return frozenset(p.name for p in _repository_files())


def _sources() -> list[Path]:
    return sorted(p for top in SCANNED for p in _walk(ROOT / top) if p.suffix in (".py", ".cu", ".cuh", ".sh"))


def _comments(path: Path) -> Iterator[tuple[int, str]]:
    """(line, text) of every comment and docstring of a Python, CUDA or shell file."""
    text = path.read_text()
    if path.suffix == ".py":
        for tok in tokenize.generate_tokens(io.StringIO(text).readline):
            if tok.type == tokenize.COMMENT:
                yield tok.start[0], tok.string
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                doc = ast.get_docstring(node, clean=False)
                if doc:
                    yield node.body[0].lineno, doc
    elif path.suffix in (".cu", ".cuh"):
        for m in re.finditer(r"//[^\n]*|/\*.*?\*/", text, re.S):
            yield text.count("\n", 0, m.start()) + 1, m.group(0)
    else:
        for i, line in enumerate(text.splitlines(), 1):
            if m := re.search(r"(?:^|\s)#(?!!)(.*)", line):
                yield i, m.group(1)


def _path_exists(name: str, named_in: Path) -> bool:
    """A path with a folder: from the top of the repository, the naming file's folder, or a package's root
    (epjit/, cuda_src/). A bare name: some file of the repository is called that."""
    if "/" not in name:
        return name in _file_names()
    bases = [ROOT, named_in.parent, ROOT / "epjit", ROOT / "cuda_src"]
    return any((base / name).exists() for base in bases)


# --- Python symbols, read statically (no import: a module may need a GPU stack to import) ---


@cache
def _tree(path: Path) -> ast.Module:
    return ast.parse(path.read_text())


def _module_file(module: str) -> Path | None:
    path = ROOT / Path(*module.split("."))
    for candidate in (path.with_suffix(".py"), path / "__init__.py"):
        if candidate.is_file():
            return candidate
    return None


def _top_level(statements: list[ast.stmt]) -> Iterator[ast.stmt]:
    """Module-level statements, including those under an `if` or `try` (TYPE_CHECKING imports, fallbacks)."""
    for node in statements:
        yield node
        if isinstance(node, (ast.If, ast.Try)):
            yield from _top_level(node.body + node.orelse + getattr(node, "finalbody", []))


def _defined(path: Path, name: str, depth: int = 0) -> ast.AST | bool:
    """The class or function ``name`` is in ``path`` (following `from x import name`), True for any other
    binding, False if the module has no such name."""
    module = ".".join(path.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    for node in _top_level(_tree(path).body):
        if isinstance(node, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.name == name:
            return node
        targets = node.targets if isinstance(node, ast.Assign) else [node.target] \
            if isinstance(node, (ast.AnnAssign, ast.AugAssign)) else []
        if any(isinstance(t, ast.Name) and t.id == name or isinstance(t, ast.Tuple) and any(
                isinstance(e, ast.Name) and e.id == name for e in t.elts) for t in targets):
            return True
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            for alias in node.names:
                if (alias.asname or alias.name.split(".")[0]) != name:
                    continue
                if isinstance(node, ast.ImportFrom) and depth < 5:
                    base = package.split(".")[:len(package.split(".")) - node.level + 1] if node.level else []
                    source = _module_file(".".join(base + ([node.module] if node.module else [])))
                    if source is not None:
                        return _defined(source, alias.name, depth + 1) or _module_file(
                            ".".join(base + [x for x in (node.module, alias.name) if x])) is not None
                return True
    if _module_file(f"{package}.{name}" if path.name == "__init__.py" else "") is not None:
        return True  # a submodule of a package
    # A name __getattr__ hands out lazily: listed in the module's own tables or __all__.
    return any(isinstance(n, ast.Constant) and n.value == name for n in ast.walk(_tree(path)))


def _class_has(cls: ast.ClassDef, member: str, path: Path, depth: int = 0) -> bool:
    """A method, class attribute, annotated field or self.<member> assignment of the class or a base class of
    this repository (a base from elsewhere may hold it: accepted)."""
    for node in ast.walk(cls):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and node.name == member:
            return True
        if isinstance(node, (ast.Assign, ast.AnnAssign)):
            for target in node.targets if isinstance(node, ast.Assign) else [node.target]:
                if isinstance(target, ast.Name) and target.id == member:
                    return True
                if isinstance(target, ast.Attribute) and target.attr == member:
                    return True
    for base in cls.bases:
        name = base.id if isinstance(base, ast.Name) else None
        found = _defined(path, name) if name else None
        if not isinstance(found, ast.ClassDef) or depth > 5:
            return True  # a base of another library, or one not read here
        if _class_has(found, member, _where_defined(name) or path, depth + 1):
            return True
    return False


@cache
def _classes() -> dict[str, list[tuple[Path, ast.ClassDef]]]:
    """Every class of the repository's Python, by name."""
    found: dict[str, list[tuple[Path, ast.ClassDef]]] = {}
    for path in _sources():
        if path.suffix == ".py":
            for node in ast.walk(_tree(path)):
                if isinstance(node, ast.ClassDef):
                    found.setdefault(node.name, []).append((path, node))
    return found


def _where_defined(class_name: str) -> Path | None:
    places = _classes().get(class_name, [])
    return places[0][0] if places else None


def _dotted_resolves(dotted: str) -> bool:
    """A dotted name from epjit: the longest prefix that is a module, then a name of it, then a member of that class."""
    parts = dotted.split(".")
    for n in range(len(parts), 0, -1):
        path = _module_file(".".join(parts[:n]))
        if path is None:
            continue
        rest = parts[n:]
        if not rest:
            return True
        found = _defined(path, rest[0])
        if not found:
            return False
        if len(rest) > 1 and isinstance(found, ast.ClassDef):
            return _class_has(found, rest[1], _where_defined(rest[0]) or path)
        return True
    return False


def _class_member_resolves(class_name: str, member: str) -> bool | None:
    """True or False for a class of this repository (any class of that name has the member); None (no opinion)
    for a name this repository does not define, unless private (a leading underscore is always ours)."""
    places = _classes().get(class_name)
    if not places:
        return False if class_name.startswith("_") else None
    return any(_class_has(cls, member, path) for path, cls in places)


def _file_symbol_resolves(file: str, symbol: str, named_in: Path) -> bool:
    path = next((base / file for base in (ROOT, named_in.parent, ROOT / "epjit") if (base / file).is_file()), None)
    if path is None:
        return False  # the path check reports it
    first, _, member = symbol.partition(".")
    found = _defined(path, first)
    if member and isinstance(found, ast.ClassDef):
        return _class_has(found, member.split(".")[0], path)
    return bool(found)


def _problems() -> Iterator[str]:
    for path in _sources():
        where = path.relative_to(ROOT)
        for line, text in _comments(path):
            for m in _PATH.finditer(text):
                if m.group(1) not in NOT_OURS and not _path_exists(m.group(1), path):
                    yield f"{where}:{line}: names {m.group(1)}, which is not in the repository"
            for m in _DOTTED.finditer(text):
                name = m.group(0)
                if name not in NOT_MODULES and not _dotted_resolves(name):
                    yield f"{where}:{line}: names {name}, which does not resolve"
            for m in _CLASS_MEMBER.finditer(text):
                if _class_member_resolves(m.group(1), m.group(2)) is False:
                    yield f"{where}:{line}: names {m.group(0)}, which no class of that name has"
            for m in _FILE_SYMBOL.finditer(text):
                if not _file_symbol_resolves(m.group(1), m.group(2), path):
                    yield f"{where}:{line}: names {m.group(1)}: {m.group(2)}, which that file does not define"


def test_every_file_and_symbol_a_comment_names_exists():
    problems = sorted(set(_problems()))
    assert not problems, "\n".join(problems)


def test_the_reader_sees_stale_references(tmp_path, monkeypatch):
    """The checks above could pass by seeing nothing: each form is found, and a stale one is reported."""
    sample = ROOT / "tests" / "test_comments.py"
    assert _path_exists("cuda_src/low_latency.cu", sample) and _path_exists("kernels/intranode.py", sample)
    assert not _path_exists("cuda_src/ceiling.cu", sample) and _path_exists("ceiling.cu", sample)
    assert _dotted_resolves("epjit.jit.spec.KernelSpec.pack") and _dotted_resolves("epjit.Buffer")
    assert _dotted_resolves("epjit.kernels.intranode") and _dotted_resolves("epjit.jit.registry.kernel_sets")
    assert not _dotted_resolves("epjit.jit.spec.KernelSpec.unpack") and not _dotted_resolves("epjit.nowhere")
    assert _class_member_resolves("KernelArgs", "set") and _class_member_resolves("KernelSpec", "SOURCE")
    assert _class_member_resolves("_Profile", "report") is False
    assert _class_member_resolves("Path", "exists") is None  # not ours: no opinion
    assert _file_symbol_resolves("epjit/kernels/intranode.py", "META_INTS", sample)
    assert not _file_symbol_resolves("epjit/kernels/intranode.py", "_Profile.report", sample)
    source = tmp_path / "x.cu"
    source.write_text("// see epjit/buffer.py: _Profile.report\n/* two\n   lines */ int x;\n")
    assert list(_comments(source)) == [(1, "// see epjit/buffer.py: _Profile.report"), (2, "/* two\n   lines */")]
