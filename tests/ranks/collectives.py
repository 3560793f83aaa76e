"""Run by every rank (under `python -m epjit.launch -n N` or `mpiexec -n N`): checks the group and its collectives.

argv: expected size, expected backend. Prints "COLLECTIVES OK rank=<r>" at the end; any failed check exits non-zero
with the reason (so the launcher/mpiexec ends the job and the test sees which rank and why).
"""

import hashlib
import os
import sys

import epjit
from epjit import ArgumentError, ArgumentTypeError, CollectiveError


def check(cond, what):
    if not cond:
        print(f"CHECK FAILED: {what}", file=sys.stderr, flush=True)
        sys.exit(17)


def pattern(rank, n):
    # Distinct, non-constant bytes per rank: a swapped or truncated payload cannot pass.
    block = hashlib.sha256(f"rank {rank}".encode()).digest()
    return (block * (n // len(block) + 1))[:n]


def main():
    size, backend = int(sys.argv[1]), sys.argv[2]
    g = epjit.init()
    r = g.rank
    check(g.size == size, f"size {g.size} != {size}")
    check(g.backend == backend, f"backend {g.backend!r} != {backend!r}")
    check(0 <= r < size, f"rank {r}")
    # One host: every rank is local, and there is one node of `size` NVLink ranks.
    check(g.local_size == size and g.local_rank == r, f"local {g.local_rank}/{g.local_size}")
    check((g.node, g.num_nodes) == (0, 1), f"node {g.node}/{g.num_nodes}")
    check((g.num_nvl_ranks, g.nvl_rank, g.nvl_node) == (size, r, 0), f"nvl {g.num_nvl_ranks} {g.nvl_rank} {g.nvl_node}")
    check(g.device is None, f"device {g.device} on a machine without GPU")
    if backend == "launcher":
        check(os.environ["EPJIT_RANK"] == str(r), "EPJIT_RANK")
        check("mpi4py" not in sys.modules, "the launcher backend imported mpi4py")
    if backend == "mpi" and "MPI_LOCALRANKID" in os.environ:
        # Hydra's own idea of the local rank must match the shared-memory split's.
        check(g.local_rank == int(os.environ["MPI_LOCALRANKID"]), f"MPI_LOCALRANKID {os.environ['MPI_LOCALRANKID']}")
        check(g.local_size == int(os.environ["MPI_LOCALNRANKS"]), "MPI_LOCALNRANKS")

    # allgather: small, different lengths (including empty), and ~4 MB per rank
    check(g.allgather_bytes(f"r{r}".encode()) == [f"r{i}".encode() for i in range(size)], "allgather small")
    got = g.allgather_bytes(b"x" * (r * 3))
    check(got == [b"x" * (i * 3) for i in range(size)], "allgather lengths")
    big = 4 * 1024 * 1024 + r * 7
    got = g.allgather_bytes(pattern(r, big))
    check([len(b) for b in got] == [4 * 1024 * 1024 + i * 7 for i in range(size)], "allgather 4MB lengths")
    check(all(got[i] == pattern(i, len(got[i])) for i in range(size)), "allgather 4MB content")
    check(g.allgather_bytes(bytearray(b"ba")) == [b"ba"] * size, "allgather bytearray")

    # bcast from every root; a 4 MB bcast; the others' data is ignored
    for root in range(size):
        got = g.bcast_bytes(f"from {root}".encode() if r == root else None, root=root)
        check(got == f"from {root}".encode(), f"bcast root {root}: {got!r}")
    got = g.bcast_bytes(pattern(99, 4 << 20) if r == size - 1 else b"ignored", root=size - 1)
    check(got == pattern(99, 4 << 20), "bcast 4MB")
    check(g.bcast_bytes(b"" if r == 0 else None) == b"", "bcast empty")

    for _ in range(5):
        g.barrier()

    check(g.allgather_object({"rank": r, "t": (r, "x")}) == [{"rank": i, "t": (i, "x")} for i in range(size)], "obj")

    g.check_same("hidden", 7168)
    if size > 1:
        disagreements(g, r, size)

    # init() again: the same group; with a disagreeing argument: an error
    check(epjit.init() is g, "second init() returned another group")
    try:
        epjit.init(num_nvl_ranks=1 if size > 1 else 2)
        check(False, "init with other args did not raise")
    except ArgumentError:
        pass

    g.barrier()
    g.close()
    print(f"COLLECTIVES OK rank={r} size={size} backend={backend} local={g.local_rank}/{g.local_size}", flush=True)


def disagreements(g, r, size):
    try:
        g.check_same("hidden", 7168 if r == 0 else 4096)
        check(False, "check_same did not raise")
    except ArgumentError as e:
        expected = "hidden differs across ranks: rank 0: 7168, " + (
            "rank 1: 4096" if size == 2 else f"ranks 1-{size - 1}: 4096"
        )
        check(expected in str(e), f"check_same message: {e}")
        check(str(e).endswith(f"(rank {r})"), f"no rank tag: {e}")

    # A bad argument on one rank: that rank gets a type error, the others a CollectiveError, nobody hangs.
    try:
        g.allgather_bytes("not bytes" if r == 1 else b"ok")
        check(False, "bad allgather input did not raise")
    except ArgumentTypeError as e:
        check(r == 1 and "str" in str(e), f"ArgumentTypeError on rank {r}: {e}")
    except CollectiveError as e:
        check(r != 1 and "rank(s) 1" in str(e), f"CollectiveError on rank {r}: {e}")
    try:
        g.bcast_bytes(None, root=0)
        check(False, "bcast of None from the root did not raise")
    except ArgumentTypeError:
        check(r == 0, "ArgumentTypeError on a non-root")
    except CollectiveError as e:
        check(r != 0 and "root rank 0" in str(e), f"bcast CollectiveError: {e}")
    # ...and the group still works afterwards
    check(g.allgather_bytes(b"%d" % r) == [b"%d" % i for i in range(size)], "allgather after errors")


if __name__ == "__main__":
    main()
