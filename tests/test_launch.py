"""`python -m epjit.launch`: ranks, the rendezvous channel, output, failure handling, timeouts, signals (CPU tier)."""

from __future__ import annotations

import re
import signal
import subprocess
import time

import pytest

from .ranks.procs import PYTHON, RANKS, ROOT, clean_env, exists, launcher, run, running, wait_until

pytestmark = pytest.mark.timeout(60)


def _pids(text: str) -> list[int]:
    return [int(p) for line in re.findall(r"PIDS ([\d ]+)", text) for p in line.split()]


@pytest.mark.parametrize("n", [2, 3, 4])
def test_collectives_under_the_launcher(n):
    res = launcher(n, "collectives.py", str(n), "launcher")
    assert res.returncode == 0, res.stderr
    for r in range(n):
        assert f"[rank {r}] COLLECTIVES OK rank={r} size={n} backend=launcher local={r}/{n}" in res.stdout
    assert "epjit.launch:" not in res.stderr


def test_output_is_prefixed_per_rank_and_stream():
    res = launcher(3, "scenarios.py", "output")
    assert res.returncode == 0, res.stderr
    out, err = res.stdout.splitlines(), res.stderr.splitlines()
    for r in range(3):
        rank_out = [line for line in out if line.startswith(f"[rank {r}] ")]
        # a rank's own lines keep their order; the unterminated last line is still ended and prefixed
        assert rank_out == [
            f"[rank {r}] out line 1 of rank {r}",
            f"[rank {r}] out line 2 of rank {r}",
            f"[rank {r}] out line 3 of rank {r}",
            f"[rank {r}] partial line of rank {r}",
        ]
        assert f"[rank {r}] err line of rank {r}" in err
    assert all(line.startswith("[rank ") for line in out)
    assert "err line" not in res.stdout and "out line" not in res.stderr


def test_failing_rank_stops_the_others_promptly_and_leaves_no_process():
    # rank 0 exits 3; rank 1 sleeps with a child process of its own; rank 2 waits in a barrier.
    res = launcher(3, "scenarios.py", "fail", timeout=30)
    assert res.returncode == 3, (res.stdout, res.stderr)
    assert res.seconds < 10
    assert "epjit.launch: rank 0 exited with code 3" in res.stderr
    pids = _pids(res.stdout)
    assert len(pids) == 4, res.stdout  # three ranks and rank 1's child
    # The launcher reaps everything before it exits: not even zombies are left.
    assert wait_until(lambda: not any(exists(p) for p in pids), 2.0), [p for p in pids if exists(p)]


def test_rank_killed_by_a_signal_is_reported(tmp_path):
    code = (
        "import os, signal, epjit; g = epjit.init(); g.rank == 1 and os.kill(os.getpid(), signal.SIGKILL); g.barrier()"
    )
    script = tmp_path / "sigkill_rank.py"
    script.write_text(code + "\n")
    res = run([PYTHON, "-m", "epjit.launch", "-n", "2", str(script)], timeout=30)
    assert res.returncode == 128 + signal.SIGKILL
    assert "rank 1 was killed by signal 9 (SIGKILL)" in res.stderr


def test_rank_leaving_during_an_allgather_gives_the_others_collective_error():
    res = launcher(3, "scenarios.py", "leave")
    assert res.returncode == 0, res.stderr  # rank 2 left with code 0; the others caught the error and ended
    for r in (0, 1):
        assert re.search(rf"\[rank {r}\] CAUGHT allgather: allgather_bytes failed: rank 2 .*\(rank {r}\)", res.stdout)
        assert f"[rank {r}] CAUGHT barrier: barrier failed: rank 2" in res.stdout
    assert "NO ERROR" not in res.stdout


def test_rank_closing_while_others_wait_fails_them_at_once():
    res = launcher(3, "scenarios.py", "closed")
    assert res.returncode == 0, res.stderr
    for r in (0, 1):
        assert f"[rank {r}] CAUGHT barrier failed: the ranks called different collectives" in res.stdout
        assert "ranks 0-1: barrier, rank 2: close" in res.stdout


def test_collective_timeout():
    res = launcher(2, "scenarios.py", "slow", EPJIT_COLLECTIVE_TIMEOUT_S="2")
    assert res.returncode == 0, res.stderr
    assert "[rank 0] CAUGHT barrier failed: timed out after 2 s" in res.stdout
    # after a timeout the channel of rank 0 is closed for good: its next call fails at once
    assert "[rank 0] CAUGHT AGAIN barrier: the group is unusable since an earlier failure" in res.stdout
    assert "[rank 1] CAUGHT AGAIN barrier failed: rank 0 " in res.stdout


def test_init_again_after_close_reuses_the_channel():
    res = launcher(2, "scenarios.py", "reinit")
    assert res.returncode == 0, res.stderr
    assert res.stdout.count("REINIT OK") == 2


def test_timeout_option_kills_everything_and_exits_124():
    # 5 s: both ranks must have started and said their pids by then, on a loaded 2-core machine too
    res = launcher(2, "scenarios.py", "sleep", opts=("--timeout", "5"), timeout=30)
    assert res.returncode == 124, (res.stdout, res.stderr)
    assert "timed out after 5 s" in res.stderr
    assert res.seconds < 12
    pids = [int(p) for p in re.findall(r"SLEEPING (\d+)", res.stdout)]
    assert len(pids) == 2
    assert wait_until(lambda: not any(exists(p) for p in pids), 2.0)


def _launch_two_sleeping_ranks() -> tuple[subprocess.Popen, list[int]]:
    """A launcher with 2 ranks that sleep, and the ranks' pids once both have said them."""
    cmd = [PYTHON, "-m", "epjit.launch", "-n", "2", str(RANKS / "scenarios.py"), "sleep"]
    proc = subprocess.Popen(cmd, cwd=ROOT, env=clean_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    pids: list[int] = []
    deadline = time.monotonic() + 20
    while len(pids) < 2 and time.monotonic() < deadline:
        pids += [int(p) for p in re.findall(r"SLEEPING (\d+)", proc.stdout.readline())]
    return proc, pids


@pytest.mark.parametrize("sig, code", [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_signal_to_the_launcher_stops_all_ranks(sig, code):
    proc, pids = _launch_two_sleeping_ranks()
    try:
        assert len(pids) == 2
        start = time.monotonic()
        proc.send_signal(sig)
        _, err = proc.communicate(timeout=15)
        assert proc.returncode == code, err
        assert time.monotonic() - start < 6
        assert f"got {signal.Signals(sig).name}" in err
        assert not any(exists(p) for p in pids)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_ranks_die_with_a_launcher_killed_hard():
    proc, pids = _launch_two_sleeping_ranks()
    try:
        assert len(pids) == 2
        proc.kill()  # SIGKILL: no chance to clean up; the ranks' parent-death signal must end them
        proc.wait(timeout=10)
        # Orphans are re-parented to PID 1, which may not reap them here: "not running" is what we can ask for.
        assert wait_until(lambda: not any(running(p) for p in pids), 5.0)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_launch_function_in_process():
    # launch() called from Python (not the command line), in a child process whose output is piped: pytest's
    # capfd raced the launcher's writer threads for the capture file once (NUL bytes in a line, in CI).
    script = (
        "import sys\nfrom epjit.launch import launch\n"
        f"code = launch(2, [{str(RANKS / 'scenarios.py')!r}, 'output'], timeout=30)\n"
        "print('FIRST', code, flush=True)\n"
        "code = launch(2, ['-c', \"import sys, os; sys.exit(int(os.environ['EPJIT_RANK']) * 5)\"], timeout=30)\n"
        "print('SECOND', code, flush=True)\n"
    )
    res = run([PYTHON, "-c", script], timeout=60, env=clean_env())
    assert "FIRST 0" in res.stdout, res.stdout + res.stderr
    assert "[rank 0] out line 1 of rank 0" in res.stdout and "[rank 1] partial line of rank 1" in res.stdout
    assert "[rank 1] err line of rank 1" in res.stderr
    assert "SECOND 5" in res.stdout and "rank 1 exited with code 5" in res.stderr


def test_launch_sets_the_environment_of_each_rank():
    # In a subprocess with piped output: capturing the launcher's in-process writes with capfd raced pytest's own
    # writers to the capture file (NUL-filled holes seen once in CI).
    probe = (
        "import os; print(*(os.environ.get(k) for k in ('EPJIT_RANK', 'EPJIT_WORLD_SIZE', 'EPJIT_LOCAL_RANK', "
        "'EPJIT_LOCAL_SIZE', 'NVSHMEM_DISABLE_NVLS', 'NCCL_NVLS_ENABLE', 'EXTRA')), "
        "os.environ['EPJIT_LAUNCH_ADDR'].startswith('127.0.0.1:'), len(os.environ['EPJIT_LAUNCH_TOKEN']))"
    )
    res = run([PYTHON, "-m", "epjit.launch", "-n", "3", "--timeout", "30", "-c", probe], timeout=60,
              env=clean_env(EXTRA="x", NCCL_NVLS_ENABLE="1"))
    assert res.returncode == 0, res.stdout + res.stderr
    for r in range(3):
        # NVSHMEM_DISABLE_NVLS defaults to 1; a value the user set (NCCL_NVLS_ENABLE=1) is kept
        assert f"[rank {r}] {r} 3 {r} 3 1 1 x True 64" in res.stdout


@pytest.mark.parametrize(
    "args, message",
    [
        (["-n", "0", "x.py"], "need at least one rank"),
        (["script.py"], "-n N (the number of ranks) is required"),
        (["-n", "2"], "nothing to run"),
        (["-n", "2", "does/not/exist.py"], "no such script: does/not/exist.py"),
        (["-n", "2", "--timeout", "0", "-m", "x"], "must be > 0"),
        (["-n", "two", "-m", "x"], "is not a number"),
        (["-n", "2", "--bogus", "-m", "x"], "unknown option --bogus"),
    ],
)
def test_command_line_errors(args, message):
    res = run([PYTHON, "-m", "epjit.launch", *args], timeout=30)
    assert res.returncode == 2
    assert message in res.stderr and "usage:" in res.stderr


def test_command_line_module_and_options():
    res = run([PYTHON, "-m", "epjit.launch", "-n2", "--timeout=20", "-m", "json.tool", "--help"], timeout=30)
    assert res.returncode == 0, res.stderr
    assert res.stdout.count("usage:") == 2 and "[rank 1] usage:" in res.stdout
    assert run([PYTHON, "-m", "epjit.launch", "--help"], timeout=30).returncode == 0


def test_launcher_imports_no_mpi():
    code = (
        "import sys, epjit.launch, epjit.group\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('mpi4py', 'cupy', 'cuda', 'torch', 'jax')))"
    )
    res = run([PYTHON, "-c", code], timeout=30)
    assert res.returncode == 0 and res.stdout.strip() == "[]", res.stdout + res.stderr


def test_processes_left_behind_by_successful_ranks_are_stopped():
    code = (
        "import subprocess, sys; "
        "print('CHILD', subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']).pid, flush=True)"
    )
    res = run([PYTHON, "-m", "epjit.launch", "-n", "2", "-c", code], timeout=30)
    assert res.returncode == 0, res.stderr
    assert res.seconds < 8
    pids = [int(p) for p in re.findall(r"CHILD (\d+)", res.stdout)]
    assert len(pids) == 2 and not any(exists(p) for p in pids)
