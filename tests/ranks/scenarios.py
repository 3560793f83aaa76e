"""Small rank programs for the launcher and group tests: `scenarios.py MODE [ARG]` (see each function)."""

import os
import subprocess
import sys
import time

import epjit
from epjit import CollectiveError


def say(*parts):
    print(*parts, flush=True)


def barrier_and_say(g, caught="CAUGHT"):
    """A barrier whose outcome the test reads from the output: NO ERROR, or CAUGHT <the CollectiveError>."""
    try:
        g.barrier()
        say("NO ERROR")
    except CollectiveError as e:
        say(f"{caught} {e}")


def fail():
    """Rank 0 exits 3 while rank 1 is stuck (with a child process of its own) and rank 2 waits in a barrier."""
    g = epjit.init()
    child = None
    if g.rank == 1:
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    say(f"PIDS {os.getpid()} {child.pid if child else ''}".strip())
    g.barrier()  # everybody has printed its pids
    if g.rank == 0:
        time.sleep(0.3)
        sys.exit(3)
    if g.rank == 1:
        time.sleep(60)
    try:
        g.barrier()
    except CollectiveError as e:
        say(f"BARRIER ERROR {e}")
    time.sleep(60)  # a rank that does not end by itself: the launcher must kill it


def leave():
    """The last rank exits (code 0, without close()) while the others wait in an allgather."""
    g = epjit.init()
    g.barrier()
    if g.rank == g.size - 1:
        time.sleep(0.2)
        os._exit(0)
    for op in ("allgather", "barrier"):
        try:
            if op == "allgather":
                g.allgather_bytes(b"x" * 1000)
            else:
                g.barrier()
            say(f"NO ERROR in {op}")
        except CollectiveError as e:
            say(f"CAUGHT {op}: {e}")


def closed():
    """The last rank closes its group and lingers while the others wait in a barrier."""
    g = epjit.init()
    g.barrier()
    if g.rank == g.size - 1:
        g.close()
        time.sleep(1.0)
        return
    barrier_and_say(g)


def slow():
    """EPJIT_COLLECTIVE_TIMEOUT_S is small; rank 1 comes to the barrier twice that late. (Not smaller than a loaded
    machine's skew between two ranks' start-up: init's own collectives wait under the same timeout.)"""
    g = epjit.init()
    if g.rank == 1:
        time.sleep(2 * float(os.environ["EPJIT_COLLECTIVE_TIMEOUT_S"]))
    barrier_and_say(g)
    if g.backend == "mpi":
        return  # rank 0's barrier is still pending in MPI; rank 1 completes it, and nobody calls another
    barrier_and_say(g, "CAUGHT AGAIN")


def sleep():
    epjit.init()
    say(f"SLEEPING {os.getpid()}")
    time.sleep(60)


def output():
    g = epjit.init()
    print(f"out line 1 of rank {g.rank}")
    print(f"err line of rank {g.rank}", file=sys.stderr)
    print(f"out line 2 of rank {g.rank}\nout line 3 of rank {g.rank}")
    sys.stdout.write(f"partial line of rank {g.rank}")  # no newline: the launcher must still end it
    sys.stdout.flush()


def nvl(arg):
    """init(num_nvl_ranks=ARG); ARG 'split' gives rank 0 a different value from the others."""
    value = (1 if int(os.environ.get("EPJIT_RANK", "0")) == 0 else 2) if arg == "split" else eval(arg)
    try:
        g = epjit.init(num_nvl_ranks=value)
    except Exception as e:  # noqa: BLE001 (the test reads the type and message)
        say(f"NVL {type(e).__name__}: {e}")
        return
    say(f"NVL ok rank={g.rank} num_nvl_ranks={g.num_nvl_ranks} nvl_rank={g.nvl_rank} nvl_node={g.nvl_node}")
    g.close()


def bind():
    try:
        epjit.init(bind_device=True)
        say("BIND no error")
    except Exception as e:  # noqa: BLE001
        say(f"BIND {type(e).__name__}: {e}")


def reinit():
    """close() then init() again in the same process: the launcher channel is reused."""
    g = epjit.init()
    g.barrier()
    g.close()
    h = epjit.init()
    got = h.allgather_bytes(bytes([h.rank]))
    say(f"REINIT {'OK' if h is not g and got == [bytes([i]) for i in range(h.size)] else 'BAD'}")
    h.close()


def mpi_split():
    """init(comm=...) on half of MPI.COMM_WORLD."""
    from mpi4py import MPI

    world = MPI.COMM_WORLD
    sub = world.Split(color=world.rank % 2, key=world.rank)
    g = epjit.init(comm=sub)
    members = [int(b) for b in g.allgather_bytes(b"%d" % world.rank)]
    ok = (
        g.backend == "mpi"
        and (g.rank, g.size) == (sub.rank, sub.size)
        and (g.local_rank, g.local_size) == (sub.rank, sub.size)
        and members == list(range(world.rank % 2, world.size, 2))
        and epjit.init() is g
    )
    try:
        epjit.init(comm=world)
        ok = False
    except epjit.ArgumentError:
        pass
    g.close()
    sub.Free()
    say(f"SPLIT {'OK' if ok else 'BAD'} world={world.rank} sub={g.rank}/{g.size} members={members}")


def raises():
    """Under MPI: the last rank dies of an exception while the others wait in a barrier; the job must end."""
    g = epjit.init()
    g.barrier()
    if g.rank == g.size - 1:
        raise RuntimeError("this rank dies on purpose")
    g.barrier()
    time.sleep(60)


if __name__ == "__main__":
    mode, args = sys.argv[1], sys.argv[2:]
    globals()[mode](*args)
