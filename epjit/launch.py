"""``python -m epjit.launch -n N [--timeout S] (-m module | script.py) [args...]``: N local ranks without MPI.

The launcher starts N copies of this Python, each in its own process group, with::

    EPJIT_RANK, EPJIT_WORLD_SIZE, EPJIT_LOCAL_RANK, EPJIT_LOCAL_SIZE   where the rank is
    EPJIT_LAUNCH_ADDR, EPJIT_LAUNCH_TOKEN                              how to reach the launcher's channel
    NVSHMEM_DISABLE_NVLS=1, NCCL_NVLS_ENABLE=0                          unless already set (no NVLink multicast)

and serves their collectives (``epjit.Group.allgather_bytes``/``bcast_bytes``/``barrier``) from a small threaded
TCP server on 127.0.0.1 (``epjit/group/rendezvous.py``), on a free port, authenticated by a random token. Every
line a rank prints comes out prefixed ``[rank i] `` (stdout to stdout, stderr to stderr). When a rank exits non-zero
or is killed, the launcher stops all the others (SIGTERM to each rank's process group, SIGKILL a few seconds
later), says which rank failed with which code, and exits with that code. Ctrl-C or SIGTERM to the launcher stops
every rank; ``--timeout S`` stops everything after S seconds and exits 124. Every child is reaped before the
launcher returns.
"""

from __future__ import annotations

import contextlib
import ctypes
import numbers
import os
import secrets
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from . import env
from .errors import ArgumentError, ArgumentTypeError, check_int, with_rank
from .group.rendezvous import RendezvousServer

USAGE = "usage: python -m epjit.launch -n N [--timeout S] (-m module | -c command | script.py) [args...]"

# How long a rank may take to die after SIGTERM before it gets SIGKILL.
_KILL_GRACE_S = 3.0
# How often the launcher looks at its children (the latency of noticing a failed rank).
_POLL_S = 0.02

_PR_SET_PDEATHSIG = 1
_PR_SET_CHILD_SUBREAPER = 36


def _libc() -> Any:
    if not sys.platform.startswith("linux"):
        return None
    try:
        return ctypes.CDLL(None, use_errno=True)
    except OSError:
        return None


# ----------------------------------------------------------------------------------------------------------------
# Processes
# ----------------------------------------------------------------------------------------------------------------


def _exit_code_text(code: int) -> str:
    if code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        return f"was killed by signal {-code} ({name})"
    return f"exited with code {code}"


def _shell_code(code: int) -> int:
    """The launcher's own exit code for a rank's: signals as a shell reports them (128 + signal)."""
    return 128 - code if code < 0 else (code or 1)


def _live_groups(pgids: set[int]) -> set[int]:
    """Those of these process groups that still have a running member (zombies do not count: nobody may ever
    reap them, e.g. when PID 1 of a container does not)."""
    proc = Path("/proc")
    live: set[int] = set()
    if not proc.is_dir():
        for pgid in pgids:
            try:
                os.killpg(pgid, 0)
            except (ProcessLookupError, PermissionError):
                continue
            live.add(pgid)
        return live
    for entry in proc.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        # "pid (comm) state ppid pgrp ...": comm may contain spaces and parentheses, so split after the last ")".
        fields = stat[stat.rfind(")") + 2 :].split()
        if len(fields) >= 3 and fields[0] not in ("Z", "X") and int(fields[2]) in pgids:
            live.add(int(fields[2]))
    return live


class _Output:
    """Prefixed, line-buffered forwarding of the ranks' pipes; one lock so lines never interleave."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._threads: list[threading.Thread] = []

    def write(self, name: str, data: bytes) -> None:
        with self._lock:
            stream = getattr(sys, name)  # looked up each time: tests and callers may swap sys.stdout
            if stream is None:
                return
            try:
                raw = getattr(stream, "buffer", None)
                if raw is not None:
                    stream.flush()  # whatever the launcher itself printed goes first
                    raw.write(data)
                    raw.flush()
                else:
                    stream.write(data.decode("utf-8", "replace"))
                    stream.flush()
            except (OSError, ValueError):
                # The launcher's own stdout is gone (e.g. `| head`): keep draining the ranks so they never block.
                pass

    def message(self, text: str) -> None:
        self.write("stderr", f"epjit.launch: {text}\n".encode())

    def forward(self, pipe: IO[bytes], rank: int, name: str) -> None:
        def pump() -> None:
            prefix = f"[rank {rank}] ".encode()
            try:
                for line in iter(pipe.readline, b""):
                    self.write(name, prefix + (line if line.endswith(b"\n") else line + b"\n"))
            except (OSError, ValueError):
                pass
            finally:
                with contextlib.suppress(OSError):
                    pipe.close()

        t = threading.Thread(target=pump, name=f"epjit-launch-{name}-{rank}", daemon=True)
        t.start()
        self._threads.append(t)

    def join(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        for t in self._threads:
            t.join(max(0.0, deadline - time.monotonic()))


class _Launcher:
    def __init__(
        self,
        n: int,
        argv: list[str],
        timeout: float | None,
        extra_env: dict[str, str] | None,
        *,
        reap_orphans: bool,
    ) -> None:
        n = check_int(n, "n (the number of ranks)", 1)
        if not argv:
            raise ValueError("nothing to run: give a script or -m module")
        if timeout is not None and (isinstance(timeout, bool) or not isinstance(timeout, numbers.Real)):
            raise ArgumentTypeError(with_rank(f"timeout must be a number of seconds or None, got {timeout!r}"))
        if timeout is not None and not timeout > 0:  # NaN too
            raise ArgumentError(with_rank(f"timeout must be > 0 seconds, got {timeout!r}"))
        self.n = n
        self.argv = [str(a) for a in argv]
        self.timeout = timeout
        self.extra_env = dict(extra_env or {})
        # With reap_orphans the launcher is a child subreaper and reaps every descendant with waitpid(-1): only
        # right when the launcher process owns nothing else (the CLI), never inside someone else's process.
        self.reap_orphans = reap_orphans
        self.out = _Output()
        self.procs: list[subprocess.Popen[bytes]] = []
        self._signal: int | None = None

    def _child_env(self, rank: int, server: RendezvousServer, token: str) -> dict[str, str]:
        e = dict(os.environ)
        e.update(self.extra_env)
        # No NVLink multicast objects (they fail on machines where the fabric manager does not provide them).
        e.setdefault("NVSHMEM_DISABLE_NVLS", "1")
        e.setdefault("NCCL_NVLS_ENABLE", "0")
        # A rank's output must reach the launcher line by line, not in 8 KB blocks when it exits.
        e.setdefault("PYTHONUNBUFFERED", "1")
        e[env.RANK] = str(rank)
        e[env.WORLD_SIZE] = str(self.n)
        e[env.LOCAL_RANK] = str(rank)
        e[env.LOCAL_SIZE] = str(self.n)
        e[env.LAUNCH_ADDR] = server.addr
        e[env.LAUNCH_TOKEN] = token
        return e

    def _spawn(self, server: RendezvousServer, token: str) -> None:
        libc = _libc()
        parent = os.getpid()

        def die_with_parent() -> None:
            # Runs in the child between fork and exec. If the launcher is SIGKILLed, its ranks must not live on.
            if libc is not None:
                libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
            if os.getppid() != parent:
                os._exit(1)  # the launcher died before prctl took effect

        cmd = [sys.executable, *self.argv]
        for rank in range(self.n):
            self.procs.append(
                subprocess.Popen(
                    cmd,
                    env=self._child_env(rank, server, token),
                    stdin=subprocess.DEVNULL,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.PIPE,
                    start_new_session=True,  # own process group: killpg reaches the rank's children too
                    preexec_fn=die_with_parent if libc is not None else None,
                )
            )

    # -- signals ------------------------------------------------------------------------------------------------

    def _on_signal(self, signum: int, frame: object) -> None:
        if self._signal is not None:
            # A second Ctrl-C: do not wait for the grace period.
            self._kill_all(signal.SIGKILL)
        self._signal = signum

    def _install_handlers(self) -> dict[int, Any]:
        if threading.current_thread() is not threading.main_thread():
            return {}
        old = {}
        for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
            old[sig] = signal.signal(sig, self._on_signal)
        return old

    # -- children -----------------------------------------------------------------------------------------------

    def _kill_all(self, sig: int) -> None:
        for p in self.procs:
            # The process group outlives its leader while the rank's own children run, so signal it even when the
            # rank itself is gone. Its id cannot be reused while any member lives.
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(p.pid, sig)

    def _reap(self, alive: set[int]) -> list[tuple[int, int]]:
        """(rank, exit code) of the ranks that ended since the last call; codes < 0 are signals."""
        done = []
        if self.reap_orphans:
            by_pid = {self.procs[r].pid: r for r in alive}
            while True:
                try:
                    pid, status = os.waitpid(-1, os.WNOHANG)
                except ChildProcessError:
                    break
                if pid == 0:
                    break
                rank = by_pid.get(pid)
                if rank is None:
                    continue  # an orphaned grandchild, re-parented to us by the subreaper flag: reaped
                code = os.waitstatus_to_exitcode(status)
                self.procs[rank].returncode = code
                done.append((rank, code))
        else:
            for r in sorted(alive):
                code = self.procs[r].poll()
                if code is not None:
                    done.append((r, code))
        return done

    def _reap_orphans_now(self) -> None:
        if not self.reap_orphans:
            return
        while True:
            try:
                pid, _ = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return

    def _finish_groups(self) -> None:
        """After every rank has ended: stop what the ranks left running in their process groups, and reap it."""
        pgids = {p.pid for p in self.procs}
        if not _live_groups(pgids):
            self._reap_orphans_now()
            return
        self._kill_all(signal.SIGTERM)
        deadline = time.monotonic() + _KILL_GRACE_S
        while time.monotonic() < deadline:
            self._reap_orphans_now()
            if not _live_groups(pgids):
                break
            time.sleep(_POLL_S)
        else:
            self._kill_all(signal.SIGKILL)
            end = time.monotonic() + 2.0
            while time.monotonic() < end and _live_groups(pgids):
                self._reap_orphans_now()
                time.sleep(_POLL_S)
        self._reap_orphans_now()

    def run(self) -> int:
        token = secrets.token_hex(32)
        server = RendezvousServer(self.n, token)
        old_handlers = self._install_handlers()
        status: int | None = None
        try:
            try:
                # All children are forked before any thread of ours starts (fork with threads running is unsafe
                # for what runs between fork and exec). The listening socket queues their connections meanwhile.
                self._spawn(server, token)
            except OSError as e:
                self.out.message(f"cannot start rank {len(self.procs)}: {e}")
                status = 1
                self._kill_all(signal.SIGKILL)
                for p in self.procs:
                    p.wait()
                return status
            server.start()
            for rank, p in enumerate(self.procs):
                if p.stdout is not None:
                    self.out.forward(p.stdout, rank, "stdout")
                if p.stderr is not None:
                    self.out.forward(p.stderr, rank, "stderr")
            status = self._wait(server)
            return status
        finally:
            self._finish_groups()
            server.close()
            self.out.join(2.0)
            for sig, handler in old_handlers.items():
                signal.signal(sig, handler)

    def _wait(self, server: RendezvousServer) -> int:
        alive = set(range(self.n))
        start = time.monotonic()
        status: int | None = None
        kill_at: float | None = None  # when SIGTERM went out
        killed_hard = False

        def stop(why: str, code: int) -> None:
            nonlocal status, kill_at
            if status is None:
                status = code
                if alive:
                    self.out.message(f"{why}; stopping rank(s) {', '.join(map(str, sorted(alive)))}")
                else:
                    self.out.message(why)
                self._kill_all(signal.SIGTERM)
                kill_at = time.monotonic()

        while alive:
            for rank, code in self._reap(alive):
                alive.discard(rank)
                server.rank_exited(rank, _exit_code_text(code))
                if code != 0 and status is None:
                    stop(f"rank {rank} {_exit_code_text(code)}", _shell_code(code))
            if not alive:
                break
            if self._signal is not None and status is None:
                name = signal.Signals(self._signal).name
                stop(f"got {name}", 128 + self._signal)
            if self.timeout is not None and status is None and time.monotonic() - start > self.timeout:
                stop(f"timed out after {self.timeout:g} s", 124)
            if kill_at is not None and not killed_hard and time.monotonic() - kill_at > _KILL_GRACE_S:
                self._kill_all(signal.SIGKILL)
                killed_hard = True
            time.sleep(_POLL_S)
        return status or 0


def launch(n: int, argv: list[str], *, timeout: float | None = None, env: dict[str, str] | None = None) -> int:
    """Run ``python argv...`` as n local ranks and return the launcher's exit code (0 when every rank exited 0).

    ``argv`` is what follows the launcher's options on the command line: ``["script.py", "arg"]`` or
    ``["-m", "package.module", "arg"]``. ``env`` adds to (or overrides) this process's environment for the ranks.
    Call it from the main thread to have Ctrl-C stop the ranks.
    """
    return _Launcher(n, argv, timeout, env, reap_orphans=False).run()


@dataclass
class _Args:
    n: int
    timeout: float | None
    argv: list[str]


def _parse(args: list[str]) -> _Args:
    n: int | None = None
    timeout: float | None = None
    i = 0

    def value(opt: str) -> str:
        nonlocal i
        if i + 1 >= len(args):
            raise ValueError(f"{opt} needs a value")
        i += 1
        return args[i]

    def number(opt: str, raw: str, conv: Callable[[str], Any]) -> Any:
        try:
            return conv(raw)
        except ValueError:
            raise ValueError(f"{opt} {raw!r} is not a number") from None

    while i < len(args):
        a = args[i]
        if a in ("-h", "--help"):
            raise _Help
        if a in ("-n", "--np", "--nproc"):
            n = number(a, value(a), int)
        elif a.startswith("--nproc=") or a.startswith("--np="):
            n = number("-n", a.split("=", 1)[1], int)
        elif a.startswith("-n") and len(a) > 2 and a[2:].isdigit():
            n = int(a[2:])
        elif a == "--timeout":
            timeout = number(a, value(a), float)
        elif a.startswith("--timeout="):
            timeout = number("--timeout", a.split("=", 1)[1], float)
        elif a == "--":
            i += 1
            break
        elif a in ("-m", "-c") or not a.startswith("-"):
            break
        else:
            raise ValueError(f"unknown option {a}")
        i += 1
    rest = args[i:]
    if n is None:
        raise ValueError("-n N (the number of ranks) is required")
    if n < 1:
        raise ValueError(f"-n {n}: need at least one rank")
    if timeout is not None and timeout <= 0:
        raise ValueError(f"--timeout {timeout:g}: must be > 0")
    if not rest:
        raise ValueError("nothing to run: give a script or -m module")
    if rest[0] in ("-m", "-c"):
        if len(rest) < 2:
            raise ValueError(f"{rest[0]} needs a {'module name' if rest[0] == '-m' else 'command'}")
    elif not Path(rest[0]).is_file():
        raise ValueError(f"no such script: {rest[0]}")
    return _Args(n, timeout, rest)


class _Help(Exception):
    pass


def main(args: list[str] | None = None) -> int:
    try:
        parsed = _parse(sys.argv[1:] if args is None else args)
    except _Help:
        print(__doc__.strip().split("\n\n")[0])
        print(USAGE)
        return 0
    except ValueError as e:
        print(f"epjit.launch: {e}\n{USAGE}", file=sys.stderr)
        return 2
    libc = _libc()
    if libc is not None:
        # Orphans of the ranks (their children, once a rank is gone) are re-parented to us, so that we reap them:
        # a container's PID 1 often does not, and they would stay zombies.
        libc.prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
    return _Launcher(parsed.n, parsed.argv, parsed.timeout, None, reap_orphans=libc is not None).run()


if __name__ == "__main__":
    sys.exit(main())
