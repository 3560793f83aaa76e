"""epjit.init / epjit.Group: backends, topology, argument checks, collectives and their failures (CPU tier)."""

from __future__ import annotations

import json
import os
import re
import socket
import struct
import threading
import time

import numpy as np
import pytest

import epjit
from epjit import group as grp
from epjit.errors import ArgumentError, ArgumentTypeError, CollectiveError
from epjit.group import bootstrap, topology
from epjit.group import channel as ch
from epjit.group.group import differs
from epjit.group.rendezvous import RendezvousServer

from .ranks.procs import PYTHON, RANKS, clean_env, launcher, mpiexec, run

pytestmark = pytest.mark.timeout(60)


# ----------------------------------------------------------------------------------------------------------------
# Pure decisions
# ----------------------------------------------------------------------------------------------------------------


def test_differs_message_lists_every_rank():
    assert differs("hidden", [7168, 4096]) == "hidden differs across ranks: rank 0: 7168, rank 1: 4096"
    assert (
        differs("hidden", [1, 1, 1, 2, 1, 1])
        == "hidden differs across ranks: ranks 0-2: 1, rank 3: 2, ranks 4-5: 1"
    )
    assert "'bf16'" in differs("dtype", ["bf16", "fp8"])


def _info(host, local_rank, local_size, gpus=0, note="no CUDA device", node_key=None, driver=False, cvd=None,
          share=False):
    return topology.RankInfo(host, node_key, local_rank, local_size, None, None, gpus, note, driver, cvd, share)


def test_topology_numbers_nodes_by_their_lowest_rank():
    # MPI keys (lowest rank of each shared-memory group), ranks placed round-robin over two hosts
    infos = [_info("b", 0, 2, node_key=0), _info("a", 0, 2, node_key=1), _info("b", 1, 2, node_key=0)]
    infos.append(_info("a", 1, 2, node_key=1))
    assert topology.number_nodes(infos) == ([0, 1, 0, 1], ["b", "a"])
    # the launcher: no key, by host name
    assert topology.number_nodes([_info("h", 0, 2), _info("h", 1, 2)]) == ([0, 0], ["h"])


@pytest.mark.parametrize(
    "nvl, nodes, local, message",
    [
        (2, [0, 0, 0, 0], [4] * 4, None),
        (4, [0, 0, 0, 0, 1, 1, 1, 1], [4] * 8, None),
        (3, [0, 0, 0, 0], [4] * 4, "num_nvl_ranks=3 does not divide the 4 ranks"),
        (8, [0, 0, 0, 0], [4] * 4, "num_nvl_ranks=8 but host h0 has only 4 rank(s)"),
        (0, [0, 0], [2, 2], "num_nvl_ranks must be >= 1, got 0"),
        # round-robin placement: ranks 0 and 1 are on different hosts
        (2, [0, 1, 0, 1], [2] * 4, "NVLink node 0 (ranks 0-1) spans hosts h0, h1"),
    ],
)
def test_nvl_problem(nvl, nodes, local, message):
    hosts = [f"h{n}" for n in nodes]
    problem = topology.nvl_problem(nvl, nodes, local, hosts)
    if message is None:
        assert problem is None
    else:
        assert problem is not None and message in problem


def test_gpu_plan():
    four = [0, 0, 0, 0]
    # enough GPUs: GPU = local rank
    plan, problem = topology.gpu_plan([_info("h", r, 4, gpus=8, note=None) for r in range(4)], None, four)
    assert (plan, problem) == ([0, 1, 2, 3], None)
    # too few
    plan, problem = topology.gpu_plan([_info("h", r, 4, gpus=2, note=None) for r in range(4)], None, four)
    assert plan == [None] * 4 and problem == "4 local ranks but only 2 GPU(s) on host h"
    # ...unless every rank asks to share them (EPJIT_SHARE_GPUS, the tests' 4 ranks on 2 GPUs): round robin
    plan, problem = topology.gpu_plan([_info("h", r, 4, gpus=2, note=None, share=True) for r in range(4)], None, four)
    assert (plan, problem) == ([0, 1, 0, 1], None)
    infos = [_info("h", r, 4, gpus=2, note=None, share=r != 3) for r in range(4)]
    assert topology.gpu_plan(infos, None, four)[1] == "4 local ranks but only 2 GPU(s) on host h"
    # a wrapper gave each rank its own GPU through CUDA_VISIBLE_DEVICES
    infos = [_info("h", r, 2, gpus=1, note=None, cvd=str(r)) for r in range(2)]
    assert topology.gpu_plan(infos, None, [0, 0]) == ([0, 0], None)
    # no GPU: CPU tier, unless a GPU is required
    infos = [_info("h", r, 2) for r in range(2)]
    assert topology.gpu_plan(infos, None, [0, 0]) == ([None, None], None)
    _, problem = topology.gpu_plan(infos, True, [0, 0])
    assert problem.startswith("bind_device=True but no GPU is visible on host h")
    assert topology.gpu_plan([_info("h", 0, 1, gpus=4, note=None)], False, [0]) == ([None], None)
    # a driver is loaded but the runtime cannot use it: refuse rather than silently run without GPUs
    infos = [_info("h", 0, 1, note="cudaGetDeviceCount: cudaErrorInsufficientDriver", driver=True)]
    _, problem = topology.gpu_plan(infos, None, [0])
    assert "has an NVIDIA driver" in problem and "cudaErrorInsufficientDriver" in problem
    # ...but CUDA_VISIBLE_DEVICES="" on a GPU machine is a deliberate CPU run
    infos = [_info("h", 0, 1, note="no CUDA device (cudaErrorNoDevice)", driver=True, cvd="")]
    assert topology.gpu_plan(infos, None, [0]) == ([None], None)
    # GPUs on one host only
    infos = [_info("a", 0, 1, gpus=1, note=None), _info("b", 0, 1)]
    _, problem = topology.gpu_plan(infos, None, [0, 1])
    assert "hosts a have GPUs but b none" in problem


@pytest.mark.parametrize(
    "environ, expected",
    [
        ({}, "single"),
        ({"EPJIT_LAUNCH_ADDR": "127.0.0.1:5"}, "launcher"),
        ({"EPJIT_LAUNCH_ADDR": "127.0.0.1:5", "OMPI_COMM_WORLD_SIZE": "2"}, "launcher"),
        ({"OMPI_COMM_WORLD_SIZE": "2"}, "mpi"),
        ({"PMI_SIZE": "1", "PMI_RANK": "0"}, "mpi"),
        ({"PMIX_RANK": "0"}, "mpi"),
        ({"SLURM_NTASKS": "4", "SLURM_PROCID": "1"}, "mpi"),
        ({"SLURM_NTASKS": "4"}, "single"),  # a batch script, not a task of srun
        ({"WORLD_SIZE": "2", "RANK": "0"}, "torch"),
        ({"WORLD_SIZE": "1"}, "single"),
        ({"WORLD_SIZE": "2", "PMI_RANK": "0"}, "mpi"),
    ],
)
def test_choose_backend(environ, expected):
    assert bootstrap._choose_backend(environ, False, False) == expected


def test_choose_backend_with_comm_or_initialised_mpi():
    assert bootstrap._choose_backend({}, True, False) == "mpi"
    assert bootstrap._choose_backend({}, False, True) == "mpi"


# ----------------------------------------------------------------------------------------------------------------
# One rank, in this process
# ----------------------------------------------------------------------------------------------------------------


@pytest.fixture
def single(monkeypatch):
    keep = clean_env()
    for name in list(os.environ):
        if name not in keep:
            monkeypatch.delenv(name)  # this process must not look like a rank of some outer job
    if grp.current() is not None:
        grp.current().close()
    # bind_device=False: pytest's own process never initialises CUDA (on GPU machines either)
    g = epjit.init(bind_device=False)
    yield g
    g.close()


def test_single_rank_group(single):
    g = single
    assert (g.rank, g.size, g.local_rank, g.local_size, g.node, g.num_nodes) == (0, 1, 0, 1, 0, 1)
    assert (g.num_nvl_ranks, g.nvl_rank, g.nvl_node, g.backend) == (1, 0, 0, "single")
    assert g.allgather_bytes(b"abc") == [b"abc"]
    assert g.bcast_bytes(b"x") == b"x"
    g.barrier()
    assert g.allgather_object({"a": 1}) == [{"a": 1}]
    g.check_same("hidden", 7168)
    with pytest.raises(ArgumentTypeError, match="data must be bytes, got str"):
        g.allgather_bytes("abc")
    with pytest.raises(ArgumentError, match="root=1 is not a rank of a group of 1"):
        g.bcast_bytes(b"x", root=1)
    with pytest.raises(ArgumentTypeError, match=r"^bcast_bytes: root must be an int, got '0'$"):
        g.bcast_bytes(b"x", root="0")
    assert g.bcast_bytes(b"x", root=np.int64(0)) == b"x"
    with pytest.raises(ArgumentTypeError, match="cannot pickle"):
        g.allgather_object(threading.Lock())


def test_second_init_returns_the_same_group(single):
    assert epjit.init() is single
    assert epjit.init(num_nvl_ranks=1) is single
    assert epjit.init(num_nvl_ranks=np.int64(1)) is single
    with pytest.raises(ArgumentError, match="num_nvl_ranks=2"):
        epjit.init(num_nvl_ranks=2)
    for value in (1.0, True, "1"):  # 1.0 == True == 1: equal to the group's, and still no rank count
        with pytest.raises(ArgumentTypeError,
                           match=rf"^num_nvl_ranks must be an int or None, got {value!r} \({type(value).__name__}\)$"):
            epjit.init(num_nvl_ranks=value)
    with pytest.raises(ArgumentError, match="bind_device=True"):
        epjit.init(bind_device=True)
    assert epjit.init(bind_device=False) is single
    with pytest.raises(ArgumentError, match="different communicator"):
        epjit.init(comm=object())


def test_first_init_takes_num_nvl_ranks_as_an_int(single):
    single.close()
    with pytest.raises(ArgumentTypeError, match=r"^num_nvl_ranks must be an int or None, got 1\.0 \(float\)$"):
        epjit.init(num_nvl_ranks=1.0, bind_device=False)
    with epjit.init(num_nvl_ranks=np.int64(1), bind_device=False) as g:
        assert g.num_nvl_ranks == 1 and type(g.num_nvl_ranks) is int


def test_closed_group(single):
    with single as g:
        pass
    assert g.closed and grp.current() is None
    with pytest.raises(CollectiveError, match="barrier: the group is closed"):
        g.barrier()
    h = epjit.init(bind_device=False)
    assert h is not g and h.allgather_bytes(b"1") == [b"1"]
    h.close()
    g.close()  # twice: no error


# ----------------------------------------------------------------------------------------------------------------
# Jobs that epjit cannot join, and the launcher/MPI backends in subprocesses
# ----------------------------------------------------------------------------------------------------------------

_INIT = "import epjit; epjit.init()"


@pytest.mark.parametrize(
    "variables, name",
    [
        ({"OMPI_COMM_WORLD_SIZE": "2", "OMPI_COMM_WORLD_RANK": "0"}, "OMPI_COMM_WORLD_SIZE=2"),
        ({"PMI_SIZE": "2", "PMI_RANK": "1"}, "PMI_SIZE=2"),
        ({"SLURM_NTASKS": "2", "SLURM_PROCID": "0"}, "SLURM_NTASKS=2"),
        ({"WORLD_SIZE": "2", "RANK": "0", "LOCAL_RANK": "0"}, "WORLD_SIZE=2"),
    ],
)
def test_several_ranks_without_a_usable_launcher_is_a_setup_error(variables, name):
    res = run([PYTHON, "-c", _INIT], timeout=30, env=clean_env(**variables))
    assert res.returncode != 0
    error = re.search(r"^epjit\.errors\.SetupError: (.*)$", res.stderr, re.M)
    assert error and name in error[1], res.stderr
    assert "mpirun -np 2 python" in error[1] and "python -m epjit.launch -n 2" in error[1]


def test_launcher_variables_without_a_launcher_is_a_setup_error():
    variables = {"EPJIT_LAUNCH_ADDR": "127.0.0.1:1", "EPJIT_RANK": "0", "EPJIT_WORLD_SIZE": "2"}
    variables.update({"EPJIT_LOCAL_RANK": "0", "EPJIT_LOCAL_SIZE": "2", "EPJIT_LAUNCH_TOKEN": "x"})
    res = run([PYTHON, "-c", _INIT], timeout=30, env=clean_env(**variables))
    assert "SetupError: rank 0 cannot join the launcher's channel: cannot connect" in res.stderr
    res = run([PYTHON, "-c", _INIT], timeout=30, env=clean_env(EPJIT_LAUNCH_ADDR="127.0.0.1:1"))
    assert "SetupError: EPJIT_LAUNCH_ADDR is set but EPJIT_RANK=None" in res.stderr


@pytest.mark.parametrize(
    "arg, expected",
    [
        ("2", "NVL ok rank={r} num_nvl_ranks=2 nvl_rank={nr} nvl_node={nn}"),
        ("None", "NVL ok rank={r} num_nvl_ranks=4 nvl_rank={r} nvl_node=0"),
        ("3", "NVL ArgumentError: num_nvl_ranks=3 does not divide the 4 ranks into NVLink nodes (rank {r})"),
        ("8", "NVL ArgumentError: num_nvl_ranks=8 but host "),
        ("split", "NVL ArgumentError: num_nvl_ranks differs across ranks: rank 0: 1, ranks 1-3: 2 (rank {r})"),
        ("'2'", "NVL ArgumentTypeError: num_nvl_ranks must be an int or None, got '2' (str) (rank {r})"),
        ("2.0", "NVL ArgumentTypeError: num_nvl_ranks must be an int or None, got 2.0 (float) (rank {r})"),
        ("__import__('numpy').int64(2)", "NVL ok rank={r} num_nvl_ranks=2 nvl_rank={nr} nvl_node={nn}"),
    ],
)
def test_num_nvl_ranks(arg, expected):
    res = launcher(4, "scenarios.py", "nvl", arg)
    assert res.returncode == 0, res.stderr
    for r in range(4):
        line = expected.format(r=r, nr=r % 2, nn=r // 2)
        assert f"[rank {r}] {line}" in res.stdout, res.stdout  # the same verdict on every rank


def test_bind_device_true_without_gpu_fails_on_every_rank():
    res = launcher(2, "scenarios.py", "bind")
    assert res.returncode == 0, res.stderr
    for r in range(2):
        assert re.search(
            rf"\[rank {r}\] BIND SetupError: bind_device=True but no GPU is visible on host .*\(rank {r}\)", res.stdout
        )


def _mpi(n: int, *args: str, **variables: str):
    """Run tests/ranks/ARGS under the mpiexec of mpi4py's MPI, or skip saying why there is none."""
    how = mpiexec(n)
    if isinstance(how, str):
        pytest.skip(how)
    cmd, extra = how
    return run([*cmd, PYTHON, str(RANKS / args[0]), *args[1:]], env=clean_env(**extra, **variables))


@pytest.mark.parametrize("n, variables", [(2, {"EPJIT_COLLECTIVE_TIMEOUT_S": "60"}), (4, {})])
def test_collectives_under_mpiexec(n, variables):
    # n=2 runs the non-blocking, deadline-polled path (a collective timeout is set); n=4 the blocking one.
    res = _mpi(n, "collectives.py", str(n), "mpi", **variables)
    assert res.returncode == 0, res.stdout + res.stderr
    found = re.findall(r"COLLECTIVES OK rank=(\d+) size=(\d+) backend=mpi local=(\d+)/(\d+)", res.stdout)
    # the shared-memory split gave local ranks 0..n-1 (collectives.py also checks them against MPI_LOCALRANKID)
    assert sorted(found) == [(str(r), str(n), str(r), str(n)) for r in range(n)]


def test_init_with_a_sub_communicator():
    res = _mpi(4, "scenarios.py", "mpi_split")
    assert res.returncode == 0, res.stdout + res.stderr
    assert res.stdout.count("SPLIT OK") == 4, res.stdout


def test_an_uncaught_exception_aborts_the_mpi_job():
    # Without the abort hook the dying rank blocks in MPI_Finalize and the job hangs until run()'s timeout.
    start = time.monotonic()
    res = _mpi(2, "scenarios.py", "raises")
    assert res.returncode != 0, res.stdout + res.stderr
    assert "this rank dies on purpose" in res.stderr
    assert time.monotonic() - start < 30, "the job did not end promptly"


def test_collective_timeout_under_mpiexec():
    res = _mpi(2, "scenarios.py", "slow", EPJIT_COLLECTIVE_TIMEOUT_S="2")
    assert res.returncode == 0, res.stdout + res.stderr
    assert "CAUGHT barrier failed: timed out after 2 s waiting for the other ranks" in res.stdout


# ----------------------------------------------------------------------------------------------------------------
# The launcher's channel, in this process: a rank that dies mid-message, a launcher that goes away, strangers
# ----------------------------------------------------------------------------------------------------------------


@pytest.fixture
def server():
    s = RendezvousServer(2, "secret")
    s.start()
    yield s
    s.close()


def _group(client: ch.Client) -> grp.Group:
    return grp.Group(
        transport=ch.LauncherTransport(client),
        backend="launcher",
        rank=client.rank,
        size=client.size,
        local_rank=client.rank,
        local_size=client.size,
        node=0,
        num_nodes=1,
        num_nvl_ranks=client.size,
        device=None,
        hosts=["h"] * client.size,
    )


def _hello(server: RendezvousServer, rank: int, token: str = "secret") -> tuple[socket.socket, bytes]:
    sock = socket.create_connection(ch.parse_addr(server.addr), timeout=10)
    hello = {"version": ch.PROTOCOL_VERSION, "token": token, "rank": rank, "size": 2, "pid": 0}
    ch.send_frame(sock, ch.REQUEST.pack(ch.HELLO, 1, 0, rank), json.dumps(hello).encode())
    return sock, bytes(ch.recv_frame(sock) or b"")


def test_channel_collectives_in_threads(server):
    clients = [ch.Client(server.addr, "secret", r, 2, timeout=20) for r in range(2)]
    out = [None, None]

    def rank(r):
        g = _group(clients[r])
        out[r] = (g.allgather_bytes(bytes([r]) * (3 << 20)), g.bcast_bytes(b"b" if r == 1 else None, root=1))
        g.barrier()

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(20)
    for r in range(2):
        gathered, bcast = out[r]
        assert gathered == [b"\0" * (3 << 20), b"\1" * (3 << 20)] and bcast == b"b"


def test_peer_dying_in_the_middle_of_a_message(server):
    good = _group(ch.Client(server.addr, "secret", 0, 2, timeout=20))
    sock, reply = _hello(server, 1)
    assert reply[0] == ch.OK
    # rank 1 announces 4 MB and dies after 1000 bytes
    sock.sendall(struct.pack("!Q", ch.REQUEST.size + (4 << 20)) + ch.REQUEST.pack(ch.ALLGATHER, 1, 0, 0) + b"x" * 1000)
    threading.Timer(0.3, sock.close).start()
    with pytest.raises(CollectiveError, match=r"allgather_bytes failed: rank 1 broke the channel protocol .* #0"):
        good.allgather_bytes(b"mine")
    # the group stays usable for an answer, and the answer is the same
    with pytest.raises(CollectiveError, match="rank 1"):
        good.barrier()


def test_launcher_going_away(server):
    g = _group(ch.Client(server.addr, "secret", 0, 2, timeout=20))
    threading.Timer(0.3, server.close).start()
    with pytest.raises(CollectiveError) as info:
        g.barrier()  # rank 1 never comes; then the launcher shuts down
    assert "barrier failed" in str(info.value)
    assert "launcher" in str(info.value)
    # depending on who is first, the launcher's last answer or the closed socket: either way an error, no hang
    with pytest.raises(CollectiveError, match="allgather_bytes.*launcher"):
        g.allgather_bytes(b"x")


def test_channel_refuses_strangers_and_duplicates(server):
    _, reply = _hello(server, 0, token="wrong")
    assert reply[0] == ch.ERROR and b"bad token" in reply
    with pytest.raises(ch.ChannelFailure, match="bad token"):
        ch.Client(server.addr, "nope", 0, 2, timeout=5)
    ch.Client(server.addr, "secret", 0, 2, timeout=5)
    with pytest.raises(ch.ChannelFailure, match="rank 0 is already connected"):
        ch.Client(server.addr, "secret", 0, 2, timeout=5)
    with pytest.raises(ch.ChannelFailure, match="thinks the world has 3 ranks"):
        ch.Client(server.addr, "secret", 1, 3, timeout=5)


def test_channel_client_timeout(server):
    g = _group(ch.Client(server.addr, "secret", 0, 2, timeout=0.3))
    with pytest.raises(CollectiveError, match=r"barrier failed: timed out after 0.3 s .*EPJIT_COLLECTIVE_TIMEOUT_S"):
        g.barrier()


def test_collective_failure_in_cleanup_keeps_the_error_being_handled(server):
    """A Buffer closed in a `finally` after an error runs a barrier; when that barrier fails too (a peer is gone),
    the first error must stay in the traceback, not be hidden behind the socket's."""
    g = _group(ch.Client(server.addr, "secret", 0, 2, timeout=0.3))
    with pytest.raises(CollectiveError, match="barrier failed") as info:
        try:
            raise MemoryError("the real problem")
        finally:
            g.barrier()
    assert isinstance(info.value.__context__, MemoryError) and not info.value.__suppress_context__


def test_torch_group_placement_by_host_names_or_torchrun_variables():
    from epjit.group.torch_dist import local_placement

    class Hosts:  # the transport's allgather, as if every rank had sent its host name
        def __init__(self, hosts):
            self.hosts = hosts

        def allgather(self, data):
            return [h.encode() for h in self.hosts]

    hosts = Hosts(["a", "a", "b", "b", "b"])
    assert [local_placement(hosts, r, False, {}, hosts.hosts[r]) for r in range(5)] == [
        (0, 2), (1, 2), (0, 3), (1, 3), (2, 3)]
    # torchrun's own numbering for its default group; a subgroup, or variables that are not numbers, by host
    assert local_placement(hosts, 3, True, {"LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "3"}, "b") == (1, 3)
    assert local_placement(hosts, 3, False, {"LOCAL_RANK": "7", "LOCAL_WORLD_SIZE": "8"}, "b") == (1, 3)
    assert local_placement(hosts, 3, True, {"LOCAL_RANK": "x", "LOCAL_WORLD_SIZE": "3"}, "b") == (1, 3)


def test_torch_group_argument_must_be_a_process_group():
    with pytest.raises(ArgumentTypeError, match="torch_group must be a torch.distributed ProcessGroup, got str"):
        epjit.init(torch_group="world")
