"""The layout shows the architecture (docs/design.md): imports run downward only, the JIT layer imports nothing else
of epjit, peer memory does not reach into the JIT, no class or function outgrows what one can read at once, and
the project refers to nothing outside itself."""

from __future__ import annotations

import ast
import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "epjit"

# Layers, bottom up: a module may import modules of lower layers, and modules of its own package (folder) at its own
# layer. The JIT layer is the bottom: it imports nothing else of epjit.
LAYERS = [
    ("epjit.jit",),
    ("epjit._version", "epjit.errors", "epjit.env"),
    # The group package, bottom up: what every transport shares; one module per transport (the launcher's channel
    # beside its server) and the topology; the Group; init.
    ("epjit.group.transport",),
    ("epjit.group.channel", "epjit.group.rendezvous", "epjit.group.mpi", "epjit.group.torch_dist",
     "epjit.group.topology"),
    ("epjit.group.group",),
    ("epjit.group.bootstrap",),
    ("epjit.group", "epjit.launch", "epjit.arrays", "epjit.memory", "epjit.reference"),
    ("epjit.kernels",),
    ("epjit.config",),
    ("epjit.ops",),
    ("epjit.front",),
    ("epjit.buffer",),
    # Your own kernels on the runtime (compile, launch by name; variants of the built-in kernels on a Buffer; later the
    # peer memory of a Buffer).
    ("epjit.lab",),
    ("epjit.bench", "epjit"),
]
# Beyond the layers: peer memory (IPC, NVSHMEM) does not reach into the JIT.
FORBIDDEN = {"epjit.memory": ("epjit.jit", "epjit.kernels")}
# A program's entry module composes the layers; it is not part of the one it sits in. The JIT layer's program
# (`python -m epjit.jit`) is not one: it finds the kernels through the entry points packages register.
ENTRY_POINTS = {"epjit.bench.__main__"}


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _layer(module: str) -> tuple[int, str]:
    """(layer, the prefix that placed it) of an epjit module: the longest matching prefix wins."""
    best = (-1, -1, "")
    for i, prefixes in enumerate(LAYERS):
        for prefix in prefixes:
            if (module == prefix or module.startswith(prefix + ".")) and len(prefix) > best[1]:
                best = (i, len(prefix), prefix)
    assert best[0] >= 0, f"{module} is in no layer: add it to LAYERS"
    return best[0], best[2]


def _imports(path: Path, module: str) -> set[str]:
    """Every epjit module ``path`` imports, at the top or inside a function."""
    package = module if path.name == "__init__.py" else module.rsplit(".", 1)[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names
                      if alias.name.split(".")[0] == "epjit" and alias.name != "epjit"}
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[:len(package.split(".")) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if target.split(".")[0] != "epjit":
                continue
            if not module.startswith(target + "."):  # a package runs before any of its modules: not a layer's import
                found.add(target)
            # `from . import jit` names a module too
            found |= {f"{target}.{alias.name}" for alias in node.names if (PACKAGE.parent / Path(
                *f"{target}.{alias.name}".split("."))).with_suffix(".py").exists()
                or (PACKAGE.parent / Path(*f"{target}.{alias.name}".split("."))).is_dir()}
    return found


def _modules() -> list[tuple[Path, str]]:
    return [(p, _module_name(p)) for p in sorted(PACKAGE.rglob("*.py")) if "__pycache__" not in p.parts]


def _problems(module: str, is_package: bool, targets: set[str]) -> list[str]:
    """What is wrong with ``module`` importing ``targets``: an import from a higher layer, or from another prefix of
    its own layer outside its own package (folder)."""
    problems = []
    layer, prefix = _layer(module)
    own_package = module if is_package else module.rsplit(".", 1)[0]
    for target in sorted(targets):
        if target == module:
            continue
        target_layer, _ = _layer(target)
        beside = target == own_package or target.startswith(own_package + ".")
        if target_layer > layer or (target_layer == layer and not target.startswith(prefix) and not beside):
            problems.append(f"{module} (layer {layer}) imports {target} (layer {target_layer})")
        for banned in FORBIDDEN.get(module, ()):
            if target == banned or target.startswith(banned + "."):
                problems.append(f"{module} must not import {target}")
    return problems


def test_imports_run_downward_only():
    problems = []
    for path, module in _modules():
        if module not in ENTRY_POINTS:
            problems += _problems(module, path.name == "__init__.py", _imports(path, module))
    assert not problems, "\n".join(problems)


def _names_outside_the_jit(path: Path) -> list[str]:
    """epjit modules other than the JIT layer's named in a string of ``path`` that is not a docstring (an
    importlib.import_module("epjit.kernels") would hide an upward import from the import reader)."""
    tree = ast.parse(path.read_text())
    docstrings = {id(node.body[0].value) for node in ast.walk(tree)
                  if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
                  and node.body and isinstance(node.body[0], ast.Expr)}
    return [m.group(0) for node in ast.walk(tree)
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings
            for m in re.finditer(r"\bepjit\.(?!jit\b)\w+", node.value)]


def test_the_jit_layer_imports_nothing_else_of_epjit():
    """The whole of epjit/jit/, its program (__main__) included: no import of the rest of epjit, and no module of it
    named in a string."""
    modules = [(path, module) for path, module in _modules() if module.startswith("epjit.jit")]
    assert "epjit.jit.__main__" in {module for _, module in modules}
    for path, module in modules:
        outside = [t for t in _imports(path, module) if not t.startswith("epjit.jit")]
        assert not outside, f"{module} imports {outside}"
        assert not _names_outside_the_jit(path), f"{module} names {_names_outside_the_jit(path)}"


def test_the_checker_sees_an_upward_import(tmp_path):
    """The checks above could pass by seeing nothing: the import reader must find relative, absolute and
    in-function imports."""
    path = PACKAGE / "memory.py"
    found = _imports(path, "epjit.memory")
    assert {"epjit.errors", "epjit.env"} <= found
    fake = tmp_path / "x.py"
    fake.write_text("from .. import arrays\ndef f():\n    from ..jit import unload_all\n    import epjit.buffer\n")
    assert _imports(fake, "epjit.ops.x") == {"epjit.arrays", "epjit.jit", "epjit.buffer"}
    # a higher layer is refused within a package and from the top of epjit/ alike; a lower one, or the same one, not
    assert _problems("epjit.group.transport", False, {"epjit.group.bootstrap"})
    assert _problems("epjit.buffer", False, {"epjit.bench"})
    assert not _problems("epjit.group.bootstrap", False, {"epjit.group.mpi", "epjit.errors"})
    assert not _problems("epjit.memory", False, {"epjit.group", "epjit.arrays"})
    fake.write_text('"""Built by epjit.kernels."""\nimport importlib\nlog = "epjit.jit"\n'
                    'importlib.import_module("epjit.kernels")\n')
    assert _names_outside_the_jit(fake) == ["epjit.kernels"]


def _spans(tree: ast.AST) -> list[tuple[str, int]]:
    spans = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            spans.append((f"{type(node).__name__} {node.name} (line {node.lineno})",
                          (node.end_lineno or node.lineno) - node.lineno + 1))
    return spans


def test_no_function_over_100_lines_and_buffer_under_350():
    long = []
    for path, module in _modules():
        for name, lines in _spans(ast.parse(path.read_text())):
            if name.startswith("FunctionDef") and lines > 100:
                long.append(f"{module}: {name}: {lines} lines")
            if name.startswith("ClassDef Buffer ") and module == "epjit.buffer":
                assert lines < 350, f"Buffer is {lines} lines"
    assert not long, "\n".join(long)


MAX_MODULE_LINES = 600


def test_no_python_file_of_the_package_over_600_lines():
    """A module one can hold in one's head: past 600 lines a module has grown a second concern."""
    over = [f"{path.relative_to(ROOT)}: {n} lines" for path, _ in _modules()
            if (n := len(path.read_text().splitlines())) > MAX_MODULE_LINES]
    assert not over, "\n".join(over)


def _tracked_text_files() -> list[Path]:
    try:
        out = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, timeout=60)
    except OSError:
        out = None
    if out is None or out.returncode != 0:
        pytest.skip("not a git checkout")
    skip = (".json", ".png", ".ipynb")
    return [ROOT / name for name in out.stdout.splitlines()
            if not name.endswith(skip) and (ROOT / name).is_file() and not name.startswith("tests/test_layers")]


def test_nothing_refers_outside_the_repository():
    """A newcomer who clones the repository can resolve every reference in it: no paths into a folder beside the
    checkout, no lab machine set-up, no issue numbers."""
    pattern = re.compile(r"\.\./shared|DESIGN\.md|gpu-machine|\.device/setup|\b[Ii]ssues? #?\d+\b")
    offenders = []
    for path in _tracked_text_files():
        for i, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
            if pattern.search(line):
                offenders.append(f"{path.relative_to(ROOT)}:{i}: {line.strip()[:100]}")
    assert not offenders, "\n".join(offenders)


def test_docs_links_resolve():
    """Every relative link of the README and docs/ names a file of the repository."""
    missing = []
    for page in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", page.read_text()):
            if "://" in target:
                continue
            if not (page.parent / target).exists():
                missing.append(f"{page.relative_to(ROOT)} -> {target}")
    assert not missing, "\n".join(missing)
