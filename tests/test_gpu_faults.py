"""GPU tier of faults: a rank killed (SIGKILL) while the others are inside a dispatch or combine kernel waiting for
it, in normal and low-latency mode, under epjit.launch and under mpirun; and a rank that is alive but stops calling.
The job must end soon (EPJIT_TIMEOUT_S + GRACE_S after the kill or the stall), say which rank was lost, and leave no
process and no shared memory behind (tests/ranks/fault.py is the rank program).

How a case decides:

- exit code: the job's (launcher's or mpirun's) is non-zero;
- time: from the victim's ``KILLING``/``STALLING`` line (its own clock, ``time.time()``; the same machine) to the
  moment the job's launcher process ended, under EPJIT_TIMEOUT_S + GRACE_S;
- naming: a survivor that prints ``RESULT`` must name the victim in its error; under epjit.launch the launcher must
  say that the victim was killed by signal 9 and list every survivor that printed nothing among the ranks it
  stopped; under mpirun, whose messages are its own (Open MPI or MPICH), the output outside the ranks' own marker
  lines must mention the victim's rank, its pid or signal 9; after a stall, every survivor's error is an
  EpjitTimeoutError "rank r timed out ... waiting for peer rank <victim>";
- processes: every process of the job, the launcher, the ranks whose pids they printed and any descendant seen
  while the job ran (sampled every 0.2 s, identified by pid and start time), is gone within 10 s of the end
  (printed pids may not even be zombies);
- shared memory: /dev/shm is listed before the job and after it. An entry that is new, belongs to this user and
  either was open or mapped by a process of the job while it ran (sampled from /proc/PID/fd and /proc/PID/maps)
  or has a name of the GPU stack (cuda, nvshmem, epjit, nccl, torch), and that no live process holds, is a leak;
  the report lists the MPI library's entries (vader, ompi, pmix, mpich, ucx) apart. Entries other software makes
  meanwhile do not count unless they have those names and nobody holds them. Nor do the CUDA driver's own files
  of a process (``cuda.shm.<uid>.<pid>.<n>``, ``mps_shm_<n>``): the driver leaves them behind every process that
  ran NVSHMEM, also one that closed its Buffers and its group and exited cleanly (seen on one H100, CUDA 13), so
  they say nothing about faults.

Processes left are killed after the check, so that the next case does not meet them; leaked entries are left for
inspection.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from .gpu import ROOT, rank_command, two_ranks
from .ranks.procs import exists, running, wait_until

pytestmark = pytest.mark.gpu

SCRIPT = "tests/ranks/fault.py"
N = 2
VICTIM = 1
TIMEOUT_S = 5  # the ranks' EPJIT_TIMEOUT_S
GRACE_S = 10  # how much longer than TIMEOUT_S the job may take to end after the kill or the stall
HARD_S = 120  # the launcher's --timeout; the test gives up on the job 30 s later
SHM = Path("/dev/shm")
# Names of the GPU stack's entries, counted even if no sample caught a process of the job holding them. Not the MPI
# libraries' (nor POSIX semaphores): other jobs on the machine make and leave those, and the job's own are caught
# held (an MPI library maps its segments for the job's whole life).
SHM_NAMES = re.compile(r"cuda|nvshmem|epjit|nccl|torch", re.IGNORECASE)
DRIVER_SHM = re.compile(r"^(cuda\.shm\.\d+\.[0-9a-f]+\.\d+|mps_shm_\d+)$")  # the CUDA driver's: see the docstring
MPI_SHM = re.compile(r"vader|ompi|pmix|mpich|ucx|sm_segment", re.IGNORECASE)  # named in a leak's report apart
MARKERS = re.compile(r"\b(READY|ENTERING|KILLING|STALLING|RESULT)\b")
MODES = ("normal", "low_latency")
OPS = ("dispatch", "combine")


# ------------------------------------------------------------------------------------------------ /proc helpers


def _processes() -> dict[int, tuple[int, int, str]]:
    """pid -> (parent pid, start time in clock ticks, state) of every process."""
    table = {}
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            stat = Path(entry.path, "stat").read_text()
        except OSError:
            continue
        fields = stat[stat.rfind(")") + 2 :].split()  # comm may hold spaces and parentheses
        table[int(entry.name)] = (int(fields[1]), int(fields[19]), fields[0])
    return table


def _family(root: int, table: dict[int, tuple[int, int, str]]) -> set[int]:
    """``root`` and its descendants."""
    children: dict[int, list[int]] = {}
    for pid, (ppid, _, _) in table.items():
        children.setdefault(ppid, []).append(pid)
    family, todo = set(), [root]
    while todo:
        pid = todo.pop()
        if pid in family:
            continue
        family.add(pid)
        todo += children.get(pid, [])
    return family & set(table)


def _start_time(pid: int) -> int | None:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return int(stat[stat.rfind(")") + 2 :].split()[19])


def _shm_name(path: str) -> str | None:
    prefix = f"{SHM}/"
    if not path.startswith(prefix):
        return None
    return path[len(prefix) :].split("/")[0].strip().removesuffix(" (deleted)")


def _shm_held(pids: object) -> set[str]:
    """The /dev/shm entries these processes have open or mapped (those we may read: our own user's)."""
    names: set[str] = set()
    for pid in pids:
        try:
            for fd in os.scandir(f"/proc/{pid}/fd"):
                try:
                    names.add(_shm_name(os.readlink(fd.path)))
                except OSError:
                    continue
            with open(f"/proc/{pid}/maps") as maps:
                for line in maps:
                    at = line.find(f"{SHM}/")
                    if at >= 0:
                        names.add(_shm_name(line[at:].rstrip("\n")))
        except OSError:
            continue
    names.discard(None)
    return names


def _shm_listing() -> set[str] | None:
    try:
        return set(os.listdir(SHM))
    except OSError:
        return None


def _mine(name: str) -> bool:
    try:
        return (SHM / name).lstat().st_uid == os.getuid()
    except OSError:
        return False  # gone meanwhile


# ------------------------------------------------------------------------------------------------ running a job


@dataclass
class Job:
    code: int
    lines: list[tuple[float, str]]  # (arrival time, line), stdout and stderr as they came
    start: float  # time.time() when the job started
    end: float  # time.time() when the job's launcher process ended
    root: int
    seen: dict[int, int] = field(default_factory=dict)  # pid -> start time of every process of the job seen
    shm: set[str] = field(default_factory=set)  # /dev/shm entries a process of the job had open or mapped

    def output(self, markers: bool = True) -> str:
        return "\n".join(text for _, text in self.lines if markers or not MARKERS.search(text))

    def tail(self, n: int = 80) -> str:
        return "\n".join(f"+{t - self.start:7.2f}s {text}" for t, text in self.lines[-n:])

    def _matches(self, pattern: str) -> list[re.Match[str]]:
        """Every line's first match of ``pattern``, in the order the lines came."""
        return [m for _, text in self.lines if (m := re.search(pattern, text))]

    def mark(self, word: str) -> float | None:
        found = self._matches(rf"\b{word} (\d+(?:\.\d+)?)\s*$")
        return float(found[0].group(1)) if found else None

    def ready(self) -> dict[int, int]:
        """rank -> pid, from the READY lines."""
        return {int(m.group(2)): int(m.group(1)) for m in self._matches(r"\bREADY (\d+) (\d+)/\d+")}

    def entered(self) -> dict[int, float]:
        return {int(m.group(1)): float(m.group(2)) for m in self._matches(r"\bENTERING (\d+) (\d+(?:\.\d+)?)")}

    def results(self) -> dict[int, dict]:
        found = {}
        for _, text in self.lines:
            if "RESULT {" in text:
                r = json.loads(text.split("RESULT ", 1)[1])
                found[r["rank"]] = r
        return found


def _pump(pipe: object, lines: list[tuple[float, str]]) -> None:
    for line in iter(pipe.readline, ""):
        lines.append((time.time(), line.rstrip("\n")))


def _kill_job(proc: subprocess.Popen, seen: dict[int, int]) -> None:
    """The hard limit passed: SIGKILL the job's process group and every process of the job still there."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except OSError:
        pass
    for pid, start in seen.items():
        if _start_time(pid) == start:
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass


def run_job(launcher: str, *args: str) -> tuple[Job, set[str] | None]:
    """Run the fault script on N ranks, watching its processes and their shared memory; (the job, /dev/shm before)."""
    env = {"EPJIT_TIMEOUT_S": str(TIMEOUT_S), **two_ranks()}
    pytest.importorskip("torch")
    cmd, full_env = rank_command(launcher, N, SCRIPT, *args, env=env, timeout=HARD_S)
    shm_before = _shm_listing()
    lines: list[tuple[float, str]] = []
    start = time.time()
    proc = subprocess.Popen(cmd, cwd=ROOT, env=full_env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, errors="replace", start_new_session=True)
    readers = [threading.Thread(target=_pump, args=(pipe, lines), daemon=True) for pipe in (proc.stdout, proc.stderr)]
    ended: list[float] = []

    def wait() -> None:
        proc.wait()
        ended.append(time.time())

    waiter = threading.Thread(target=wait, daemon=True)
    for t in (*readers, waiter):
        t.start()
    job = Job(0, lines, start, 0.0, proc.pid)
    deadline = time.monotonic() + HARD_S + 30
    while waiter.is_alive():
        table = _processes()
        family = _family(proc.pid, table)
        for pid in family:
            job.seen.setdefault(pid, table[pid][1])
        job.shm |= _shm_held(family)
        if time.monotonic() > deadline:
            _kill_job(proc, job.seen)
            waiter.join(10)
            pytest.fail(f"the job ran past {HARD_S + 30} s and was killed\n{job.tail()}")
        waiter.join(0.2)
    for t in readers:
        t.join(10)  # a process of the job left holding the pipes: the process check below says so
    job.code, job.end = proc.returncode, ended[0]
    return job, shm_before


# ------------------------------------------------------------------------------------------------ checks


def _left(job: Job) -> dict[int, str]:
    """pid -> command line of the job's processes that are still there: the launcher and the pids the ranks printed
    even as zombies (their parent must reap them), the other processes seen while it ran if they still run."""
    named = {*job.ready().values(), job.root}
    left = [pid for pid in named if exists(pid)]
    left += [pid for pid, start in job.seen.items()
             if pid not in named and running(pid) and _start_time(pid) == start]
    commands = {}
    for pid in sorted(left):
        try:
            raw = Path(f"/proc/{pid}/cmdline").read_bytes()
            commands[pid] = raw.replace(b"\0", b" ")[:200].decode(errors="replace")
        except OSError:
            commands[pid] = "?"
    return commands


def _leaked(job: Job, before: set[str]) -> set[str]:
    now = _shm_listing() or set()
    new = {name for name in now - before
           if (name in job.shm or SHM_NAMES.search(name)) and not DRIVER_SHM.match(name) and _mine(name)}
    if not new:
        return set()
    return new - _shm_held(_processes())


def check_ended(job: Job, shm_before: set[str] | None, origin_word: str) -> float:
    """Exit code, time from the victim's mark to the end, no process and no shared memory left; the mark's time."""
    origin = job.mark(origin_word)
    assert origin is not None, f"the victim never printed {origin_word}\n{job.tail()}"
    assert job.code != 0, f"the job exited 0\n{job.tail()}"
    elapsed = job.end - origin
    assert elapsed < TIMEOUT_S + GRACE_S, f"the job ended {elapsed:.1f} s after {origin_word}\n{job.tail()}"
    print(f"FAULT: exit code {job.code}, ended {elapsed:.1f} s after {origin_word}")
    if not wait_until(lambda: not _left(job), 10):
        left = _left(job)
        for pid in left:  # the job's own processes (pid and start time checked): not for the next case to meet
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
        pytest.fail(f"processes of the job still there 10 s after it ended (now killed): {left}\n{job.tail()}")
    if shm_before is not None and not wait_until(lambda: not _leaked(job, shm_before), 5):
        leaked = _leaked(job, shm_before)
        mpi = sorted(name for name in leaked if MPI_SHM.search(name))
        pytest.fail(f"/dev/shm entries the job left: {sorted(leaked - set(mpi))}, and of the MPI library: {mpi} "
                    f"(entries the job held while it ran: {sorted(job.shm)})\n{job.tail()}")
    return origin


def names_victim(text: str | None) -> bool:
    return text is not None and re.search(rf"\brank {VICTIM}\b", text) is not None


# ------------------------------------------------------------------------------------------------ the cases


@pytest.mark.parametrize("launcher", ["launch", "mpirun"])
@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("mode", MODES)
def test_a_rank_killed_inside_the_op_ends_the_job(mode, op, launcher):
    job, shm_before = run_job(launcher, "--mode", mode, "--op", op, "--how", "kill", "--victim", str(VICTIM))
    killed_at = check_ended(job, shm_before, "KILLING")
    survivors = [r for r in range(N) if r != VICTIM]
    entered, results = job.entered(), job.results()
    for r in survivors:
        assert r in entered and entered[r] < killed_at, f"rank {r} was not inside the op at the kill\n{job.tail()}"
        if r in results:
            assert names_victim(results[r]["error"]), f"rank {r} saw {results[r]}\n{job.tail()}"
    if launcher == "launch":
        stop = re.search(rf"epjit\.launch: rank {VICTIM} was killed by signal 9 \(SIGKILL\)"
                         r"(?:; stopping rank\(s\) ([\d, ]+))?", job.output())
        assert stop, f"the launcher did not say that rank {VICTIM} was killed\n{job.tail()}"
        stopped = {int(r) for r in (stop.group(1) or "").split(",") if r.strip()}
        quiet = [r for r in survivors if r not in results and r not in stopped]
        assert not quiet, f"rank(s) {quiet} neither saw an error nor were stopped by the launcher\n{job.tail()}"
    else:
        victim_pid = job.ready().get(VICTIM)
        said = rf"\brank {VICTIM}\b|signal 9|SIGNAL: 9|SIGKILL" + (rf"|\b{victim_pid}\b" if victim_pid else "")
        assert re.search(said, job.output(markers=False), re.IGNORECASE), (
            f"nothing in mpirun's output names rank {VICTIM}, its pid or signal 9\n{job.tail()}")


@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("mode", MODES)
def test_a_rank_that_stops_calling_times_out_naming_it(mode, op):
    job, shm_before = run_job("launch", "--mode", mode, "--op", op, "--how", "stall", "--victim", str(VICTIM))
    check_ended(job, shm_before, "STALLING")
    results = job.results()
    for r in (r for r in range(N) if r != VICTIM):
        assert r in results, f"rank {r} printed no RESULT\n{job.tail()}"
        res = results[r]
        assert res["error_type"] == "EpjitTimeoutError", f"rank {r} saw {res}\n{job.tail()}"
        assert f"rank {r} timed out" in res["error"], res
        assert f"waiting for peer rank {VICTIM}" in res["error"], res
    assert re.search(rf"epjit\.launch: rank \d+ exited with code \d+; stopping rank\(s\) [\d, ]*\b{VICTIM}\b",
                     job.output()), f"the launcher did not stop rank {VICTIM}\n{job.tail()}"
