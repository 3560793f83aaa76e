"""The product holds only what a user runs and what proves it: every saved benchmark run under bench/results/ is
cited by a page of the docs and every run a page cites is there (earlier runs are in the git history); every
script under scripts/ is a documented tool that uses epjit's public API only, never a private member; and every
link of the docs into a page's section names a heading of that page."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"
SCRIPTS = ROOT / "scripts"
# A saved run's name: DATE-<gpu>xN-what.json, e.g. 2026-11-27-h200x2-latency-floor-1.json.
RUN_NAME = re.compile(r"\b\d{4}-\d{2}-\d{2}-[a-z]\d+x\d+-[A-Za-z0-9._-]*?\.json\b")


def _pages() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def _docs_text() -> str:
    return "\n".join(page.read_text() for page in _pages() if page.is_file())


def _cited_runs() -> dict[str, list[str]]:
    """Each run name the docs cite, with the pages that cite it."""
    cited: dict[str, list[str]] = {}
    for page in _pages():
        if page.is_file():
            for name in RUN_NAME.findall(page.read_text()):
                cited.setdefault(name, []).append(page.name)
    return cited


def _needs_results() -> None:
    if not RESULTS.is_dir():
        pytest.skip("no bench/results/ here (not a checkout)")


def test_every_saved_run_is_cited_by_the_docs():
    _needs_results()
    cited = _cited_runs()
    uncited = sorted(p.name for p in RESULTS.iterdir() if p.name not in cited)
    assert not uncited, ("bench/results/ keeps only the runs a page cites (cite these, or remove them; git history "
                         "keeps them): " + ", ".join(uncited))


def test_every_cited_run_is_saved():
    _needs_results()
    missing = sorted(f"{name} (cited by {', '.join(sorted(set(pages)))})"
                     for name, pages in _cited_runs().items() if not (RESULTS / name).is_file())
    assert not missing, "runs the docs cite that bench/results/ lacks: " + "; ".join(missing)


def test_runs_are_cited_by_their_whole_name():
    """A shortened name (``...-h200x2-intranode.json``, ``-2.json``) is one the two checks above cannot follow."""
    short = re.compile(r"(?<!\d{4}-\d{2}-\d{2}-)\b[a-z]\d+x\d+-[A-Za-z0-9._-]*?\.json|`-\d\.json`")
    offenders = [f"{page.name}: {m}" for page in _pages() if page.is_file() for m in short.findall(page.read_text())]
    assert not offenders, "cite saved runs by their whole name: " + "; ".join(offenders)


def test_the_run_name_pattern_finds_citations():
    text = "rows from `bench/results/2026-11-27-h200x2-latency-floor-1.json` and `2026-11-25-h100x1-host-path.json`."
    assert RUN_NAME.findall(text) == ["2026-11-27-h200x2-latency-floor-1.json", "2026-11-25-h100x1-host-path.json"]


def _private_uses(source: str) -> list[str]:
    """Every ``obj._name`` (not a dunder) and every private name imported, with its line."""
    uses = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__"):
            uses.append(f"{node.lineno}: .{node.attr}")
        elif isinstance(node, ast.ImportFrom):
            module = node.module or ""
            names = [a.name for a in node.names] + module.split(".")
            uses += [f"{node.lineno}: import {n}" for n in names if n.startswith("_") and not n.startswith("__")]
    return uses


def test_no_script_reads_a_private_member():
    offenders = [f"{path.relative_to(ROOT)}:{use}" for path in sorted(SCRIPTS.glob("*.py"))
                 for use in _private_uses(path.read_text())]
    assert not offenders, "scripts use the public API only (add an accessor where a tool needs one):\n" + "\n".join(
        offenders)


def test_the_private_member_check_sees_one():
    assert _private_uses("import epjit\nbuf.low_latency_dispatch(x)\nbuf.__class__\n") == []
    assert _private_uses("n = buf._ll.num_sms\n") == ["1: ._ll"]
    assert _private_uses("from epjit.bench import _graph\n") == ["1: import _graph"]


def test_every_script_is_documented():
    text = _docs_text()
    undocumented = sorted(p.name for p in SCRIPTS.iterdir() if p.is_file() and p.name not in text)
    assert not undocumented, "scripts the docs do not name (document them, or remove them): " + ", ".join(
        undocumented)


def _slug(heading: str) -> str:
    """A heading's anchor as GitHub makes it: lower case, punctuation but hyphens dropped, spaces as hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def test_docs_section_links_resolve():
    """Every ``page.md#section`` link of the README and docs/ names a heading of that page (a renamed heading
    breaks the links to it silently otherwise)."""
    missing = []
    for page in _pages():
        for target, anchor in re.findall(r"\]\(([^)#\s]*)#([^)\s]+)\)", page.read_text()):
            dest = page.parent / target if target else page
            if "://" in target or dest.suffix != ".md" or not dest.is_file():
                continue
            if anchor not in {_slug(h) for h in re.findall(r"(?m)^#+ (.*)$", dest.read_text())}:
                missing.append(f"{page.relative_to(ROOT)} -> {target}#{anchor}")
    assert not missing, "\n".join(missing)


def test_the_slug_is_githubs():
    assert _slug("One node's symmetric region on CUDA IPC memory") == "one-nodes-symmetric-region-on-cuda-ipc-memory"
    assert _slug("Low-latency fences, acks, flags and blocks") == "low-latency-fences-acks-flags-and-blocks"
    assert _slug("`jit --resources`") == "jit---resources"
