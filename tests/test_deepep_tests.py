"""CPU tier of scripts/deepep_tests.py (DeepEP's own test scripts on epjit): the copy's substitutions find their
targets (in the DeepEP checkout DEEPEP_SOURCE names, if any, else in a
stand-in), the generated ``deep_ep`` module resolves to epjit.deep_ep, and bench_kineto finds epjit's kernels. The
scripts themselves run in the GPU tier (test_gpu_deepep_tests.py)."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def runner():
    spec = importlib.util.spec_from_file_location("deepep_tests", ROOT / "scripts" / "deepep_tests.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _stand_in(tmp_path: Path, runner) -> Path:
    tests = tmp_path / "DeepEP" / "tests"
    tests.mkdir(parents=True)
    for name in runner.SCRIPTS:
        (tests / name).write_text("".join(f"{text}\n" for file, text, _ in runner.SUBSTITUTIONS if file == name))
    (tests / "utils.py").write_text("def bench_kineto(fn, kernel_names):\n    raise AssertionError\n")
    return tests.parent


def test_prepare_substitutes_and_writes_the_deep_ep_module(runner, tmp_path):
    tests = runner.prepare(_stand_in(tmp_path, runner), tmp_path / "run", 2)
    internode = (tests / "test_internode.py").read_text()
    assert "== 8" not in internode and "assert num_ranks > num_local_ranks" in internode
    assert (tests / "utils.py").read_text().endswith(runner.UTILS_TAIL)
    shim = tmp_path / "run" / "shim"
    code = "import deep_ep, epjit.deep_ep, epjit.deep_ep.buffer as b; assert deep_ep is epjit.deep_ep, deep_ep; " \
           "import deep_ep.utils; print(b._num_nvl_ranks)"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(shim), str(ROOT)]))
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "2", out.stderr


def test_prepare_refuses_a_checkout_whose_targets_moved(runner, tmp_path):
    source = _stand_in(tmp_path, runner)
    (source / "tests" / "test_internode.py").write_text("nothing to change\n")
    with pytest.raises(ValueError, match="expected"):
        runner.prepare(source, tmp_path / "run", 2)


def test_the_substitutions_find_their_targets_in_a_deepep_checkout(runner, tmp_path):
    source = os.environ.get("DEEPEP_SOURCE")
    if not source or not (Path(source) / "tests" / "test_internode.py").is_file():
        pytest.skip("no DeepEP checkout: DEEPEP_SOURCE names none")
    tests = runner.prepare(Path(source), tmp_path / "run", 2)
    for name in runner.SCRIPTS:
        body = (tests / name).read_text()
        assert "import deep_ep" in body and "num_local_ranks == 8" not in body
    assert "kernel_names=('dispatch', 'combine')" in (tests / "test_low_latency.py").read_text()


def test_bench_kineto_finds_epjits_kernels_by_deepeps_names(runner):
    def kernel(name, ts, dur):
        return {"cat": "kernel", "name": f"void epjit::{name}<8, 7168>(epjit::PeersTable const*)", "ts": ts,
                "dur": dur}

    events = [kernel("ll_dispatch", 0, 10), kernel("ll_combine", 5, 4), kernel("ll_dispatch", 9, 30),
              kernel("dispatch_layout", 12, 99)]
    assert runner._durations(events, "dispatch", 1) == pytest.approx(20e-6)  # not the layout kernel
    assert runner._durations(events, "dispatch", 2) == pytest.approx([10e-6, 30e-6])  # send, receive halves
    assert runner._durations(events, "combine", 1) == pytest.approx(4e-6)
    assert runner._durations(events, "notify", 1) == 0.0  # a step epjit runs no kernel for
