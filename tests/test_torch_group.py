"""epjit's group over torch.distributed, on the CPU: jobs started by torchrun (a default process group epjit makes,
or the script's own) and any torch ProcessGroup passed as ``torch_group`` (a subgroup). Needs torch; without it
these tests skip and say so (the GPU machines have it)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from .gpu import ROOT, result_dicts

torch = pytest.importorskip("torch", reason="torch is not installed: the torch.distributed transport is not tested")


def torchrun(case: str, n: int = 3, timeout_s: int = 60, must_pass: bool = True) -> list[dict]:
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "EPJIT_COLLECTIVE_TIMEOUT_S": str(timeout_s)}
    # torch's own folder too, where the tests found torch outside this interpreter's site-packages
    paths = [str(ROOT), str(Path(torch.__file__).parent.parent), env.get("PYTHONPATH", "")]
    env["PYTHONPATH"] = os.pathsep.join(p for p in paths if p)
    env.pop("CUDA_VISIBLE_DEVICES", None)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(n),
           "tests/ranks/torch_group.py", case]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0 or not must_pass, (proc.stdout + proc.stderr)[-6000:]
    results = sorted(result_dicts(proc.stdout), key=lambda r: r["global_rank"])
    assert len(results) == n or not must_pass, proc.stdout[-4000:]
    return results


def _check_collectives(results: list[dict], size: int) -> None:
    for r in results:
        assert r["backend"] == "torch" and r["size"] == size
        assert r["local"] == [r["rank"], size] and r["nvl"] == [size, r["rank"]] and r["device"] is None
        assert r["allgather_ok"] and r["empty_ok"] and r["bcast"] == "root payload"
        assert "hidden differs across ranks: rank 0: 7168" in r["differs"]
        if r["rank"] == 0:
            assert r["unpicklable"].startswith("ArgumentTypeError") or r["unpicklable"].startswith("ArgumentError")
        else:
            assert r["unpicklable"].startswith("CollectiveError") and "rank(s) 0 passed invalid" in r["unpicklable"]


def test_torchrun_without_a_process_group_gets_one_that_close_destroys():
    results = torchrun("default")
    _check_collectives(results, 3)
    assert all(r["again_same"] and r["default_destroyed"] for r in results)


def test_torchrun_with_the_scripts_own_group_joins_it_and_leaves_it_up():
    results = torchrun("own")
    _check_collectives(results, 3)
    for r in results:
        assert r["default_kept"]
        assert "different torch process group" in r["other_group"]


def test_a_torch_subgroup_is_a_group_of_its_ranks():
    results = torchrun("subgroup", n=3)
    _check_collectives(results[:2], 2)
    assert results[2].get("outside")


def test_a_rank_late_to_a_collective_times_the_others_out():
    """The ranks on time raise CollectiveError after EPJIT_COLLECTIVE_TIMEOUT_S and the group is marked broken.
    (gloo then aborts those processes at exit, with its timed-out operation still pending, and torchrun ends the
    late rank: the job fails, as it should; what is checked is the error the ranks on time raised first.)"""
    results = torchrun("stall", timeout_s=3, must_pass=False)
    on_time = [r for r in results if r["global_rank"] != 1]
    assert len(on_time) == 2, results
    for r in on_time:
        assert "barrier failed: torch.distributed (gloo)" in r["stall_error"] and r["broken"], r
        assert 2.5 <= r["waited_s"] <= 6.5, r
