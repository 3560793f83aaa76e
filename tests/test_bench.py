"""The benchmark's command line without a GPU: its protocol rules hold before anything is timed; the internode
rows' RDMA-leg accounting and the put ceiling's kernel spec."""

from __future__ import annotations

import inspect
import json
import os
import re
import subprocess
import sys
import types
from dataclasses import asdict
from pathlib import Path

import numpy as np
import pytest

from epjit import bench
from epjit.bench import cli, normal, peers, protocol, report, roles
from epjit.bench.kernels import PUT_CEILING_HEADER_BYTES, PutCeilingSpec, bench_specs, put_ceiling_heap_bytes
from epjit.kernels import cuda_sources

_LAUNCHER_SIZES = ("EPJIT_WORLD_SIZE", "OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "WORLD_SIZE")


@pytest.fixture
def launched_ranks(monkeypatch):
    """Make the benchmark see a job of ``n`` ranks, as the launcher tells its ranks."""
    for name in (*_LAUNCHER_SIZES, "EPJIT_SHARE_GPUS"):
        monkeypatch.delenv(name, raising=False)

    def set_ranks(n: int) -> None:
        monkeypatch.setenv("EPJIT_WORLD_SIZE", str(n))

    return set_ranks


def test_fewer_than_twenty_repeats_are_refused(capsys):
    with pytest.raises(SystemExit) as e:
        bench.main(["--repeat", "5"])
    assert e.value.code == 2
    assert "--repeat must be >= 20" in capsys.readouterr().err


@pytest.mark.parametrize("spin", ["50", "200000"])
def test_a_spin_outside_its_range_is_refused(spin, capsys):
    with pytest.raises(SystemExit) as e:
        bench.main(["--spin-us", spin])
    assert e.value.code == 2
    assert f"--spin-us must be in [100, 100000], got {spin}" in capsys.readouterr().err


def test_the_spin_is_what_the_protocol_launches():
    from epjit.bench import protocol

    try:
        protocol.set_spin_us(2000)
        assert protocol._HIDE_LAUNCH_NS == 2_000_000
    finally:
        protocol.set_spin_us(500)


def test_ranks_sharing_gpus_are_not_timed(capsys, monkeypatch):
    monkeypatch.setenv("EPJIT_SHARE_GPUS", "1")
    with pytest.raises(SystemExit) as e:
        bench.main([])
    assert e.value.code == 2
    assert "time-sliced, so their timings mean nothing" in capsys.readouterr().err


def test_help_names_every_mode():
    out = subprocess.run([sys.executable, "-m", "epjit.bench", "--help"], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    for mode in ("dispatch", "dispatch-fp8", "combine", "ll-dispatch", "ll-combine", "ll-hook", "ceiling",
                 "put-ceiling", "--num-nvl-ranks", "--put-ceiling", "--put-sms", "--put-warps", "--put-chunks",
                 "--rdma-chunk-send", "--rdma-chunk-recv"):
        assert mode in out.stdout, mode


def test_summary_prints_earlier_rows_without_a_gpu(tmp_path, capsys):
    row = bench.Row("combine", 4096, 7168, 8, 256, 24, 4, 512.5, 640.0, 310.0, 420.0, 250.0, 1.25, 90.0)
    path = tmp_path / "rows.json"
    path.write_text(json.dumps({"meta": {}, "rows": [asdict(row)]}))
    assert bench.main(["--summary", str(path)]) == 0
    (line,) = [line for line in capsys.readouterr().out.splitlines() if line.startswith("combine")]
    assert line.split()[:6] == ["combine", "4096", "7168", "24", "4", "512.5"]
    assert "1.25" in line.split()


def test_summary_refuses_a_file_without_rows(tmp_path, capsys):
    """A file of another tool (scripts/host_path.py writes "runs"), or one that is not JSON, ends in a message
    naming it, before any row is printed, rather than in a traceback."""
    rows = tmp_path / "rows.json"
    rows.write_text(json.dumps({"meta": {}, "rows": [asdict(bench.Row("combine", 1, 2, 1, 2, 2, 2, 1.0, None, 1.0,
                                                                       1.0, None, None, 1.0))]}))
    for content, message in (({"meta": {}, "runs": []}, "no benchmark rows in it"), ("{", "Expecting")):
        other = tmp_path / "other.json"
        other.write_text(content if isinstance(content, str) else json.dumps(content))
        with pytest.raises(SystemExit) as e:
            bench.main(["--summary", str(rows), str(other)])
        assert e.value.code == 2
        out, err = capsys.readouterr()
        assert f"--summary {other}: {message}" in err and "Traceback" not in err
        assert "combine" not in out


def test_the_saved_results_print_with_summary(capsys):
    """Every file of bench/results/ the benchmark wrote prints as one table, old fields and all."""
    results = sorted((Path(__file__).resolve().parents[1] / "bench" / "results").glob("*.json"))
    written = [str(p) for p in results if "rows" in json.loads(p.read_text())]
    if not written:
        pytest.skip("no bench/results/ here")
    assert bench.main(["--summary", *written]) == 0
    rows = sum(len(bench.load_rows(p)) for p in written)
    assert len(capsys.readouterr().out.splitlines()) >= rows


# --------------------------------------------------------------------------------- what the benchmark needs to run

_HIDE_TORCH = "import sys; sys.modules['torch'] = None"  # `import torch` then raises ModuleNotFoundError


def _fake_torch(cuda: str | None = None, gpus: bool = False, nccl: bool = True) -> dict[str, types.ModuleType]:
    """torch and torch.distributed as a machine without a GPU has them: ``cuda`` the build's CUDA version (None: a
    CPU-only build), ``gpus`` what torch.cuda.is_available() says, ``nccl`` whether torch.distributed has NCCL."""
    torch = types.ModuleType("torch")
    torch.__version__ = f"2.5.1+{'cu' + cuda.replace('.', '') if cuda else 'cpu'}"
    torch.version = types.SimpleNamespace(cuda=cuda)
    torch.cuda = types.SimpleNamespace(is_available=lambda: gpus)
    dist = types.ModuleType("torch.distributed")
    dist.is_available = lambda: True
    dist.is_nccl_available = lambda: nccl
    torch.distributed = dist
    return {"torch": torch, "torch.distributed": dist}


@pytest.mark.parametrize("modules, message, how", [
    ({"torch": None}, "PyTorch is missing: `import torch` failed (ModuleNotFoundError", "pip install torch"),
    (_fake_torch(), "no GPU: PyTorch 2.5.1+cpu sees none here (a CPU-only build: torch.version.cuda is None)",
     "run it on a machine with NVIDIA GPUs"),
    (_fake_torch("12.4"), "no GPU: PyTorch 2.5.1+cu124 sees none here (torch.cuda.is_available() is False",
     "CUDA_VISIBLE_DEVICES="),
    (_fake_torch("12.4", gpus=True, nccl=False), "NCCL is missing", "a CUDA build of PyTorch for Linux"),
    ({**_fake_torch("12.4", gpus=True), "cupy": None}, "CuPy is missing: `import cupy` failed",
     "pip install 'epjit[cuda13]'"),
])
def test_a_machine_without_what_the_benchmark_needs_is_told_what_to_install(modules, message, how, monkeypatch,
                                                                             launched_ranks, capsys):
    """Without torch, a GPU, NCCL or CuPy, every rank ends in one paragraph that names what is missing and how to get
    it, with exit code 2, before it joins a group (no traceback from deep inside the first call needing it)."""
    launched_ranks(2)
    for name, module in modules.items():
        monkeypatch.setitem(sys.modules, name, module)
    monkeypatch.setattr(cli, "init_with_nccl", lambda *args: pytest.fail("the ranks started without a GPU"))
    with pytest.raises(SystemExit) as e:
        bench.main(["--tokens", "128"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("python -m epjit.bench: error: ") and err.count("\n") == 1, err
    assert message in err and how in err


@pytest.mark.parametrize("prelude, message", [
    (_HIDE_TORCH, "PyTorch is missing"),
    ("import sys, tests.test_bench as t; sys.modules.update(t._fake_torch())", "no GPU: PyTorch 2.5.1+cpu"),
])
def test_python_m_epjit_bench_without_torch_or_a_gpu_ends_in_a_message(prelude, message, tmp_path):
    """The command as a newcomer types it, in a fresh process: the message and exit code 2, and --summary and --help
    still work there (they need neither)."""
    root = Path(__file__).resolve().parents[1]
    env = {k: v for k, v in os.environ.items() if k not in (*_LAUNCHER_SIZES, "EPJIT_SHARE_GPUS")}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(root), env.get("PYTHONPATH")]))

    def bench_command(*argv: str) -> subprocess.CompletedProcess:
        code = f"{prelude}; import runpy; sys.argv = ['bench', *{list(argv)!r}]; runpy.run_module('epjit.bench', " \
               "run_name='__main__')"
        return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=root,
                              env=env)

    out = bench_command()
    assert out.returncode == 2, out.stderr
    assert out.stderr.startswith(f"python -m epjit.bench: error: {message}") and out.stderr.count("\n") == 1, \
        out.stderr
    assert "Traceback" not in out.stderr and "--summary" in out.stderr
    assert bench_command("--help").returncode == 0
    saved = tmp_path / "rows.json"
    saved.write_text(json.dumps({"meta": {}, "rows": [asdict(bench.Row("combine", 4096, 7168, 8, 256, 24, 4, 512.5,
                                                                         None, 310.0, 420.0, None, None, 90.0))]}))
    out = bench_command("--summary", str(saved))
    assert out.returncode == 0 and "512.5" in out.stdout, out.stderr


@pytest.mark.parametrize("ranks", [2, 4])
def test_each_operation_is_timed_with_its_own_default_chunk(ranks):
    from epjit.config import get_combine_config, get_dispatch_config

    for mode, default in (("combine", get_combine_config(ranks)), ("dispatch", get_dispatch_config(ranks)),
                          ("dispatch-fp8", get_dispatch_config(ranks))):
        cfg = bench.case_config(mode, ranks, 24, 0, 256)
        assert (cfg.num_sms, cfg.nvl_chunk_send, cfg.nvl_chunk_recv) == (24, default.nvl_chunk_send, 256), mode
    assert bench.case_config("combine", ranks, 16, 20, 256).nvl_chunk_send == 20  # --chunk-send wins
    # On 2 ranks the two defaults differ, which is what the benchmark once missed.
    assert ranks != 2 or get_combine_config(2).nvl_chunk_send != get_dispatch_config(2).nvl_chunk_send


def test_a_warp_role_run_is_timed_with_its_own_chunks():
    """With --warp-roles (scripts/gpu_variants.sh) each case gets the chunks a plain call with those roles gets: a
    phased dispatch sends 48-token chunks on 4 ranks (12 warps in one group), a 5-sender combine 15 rows."""
    roles = bench.parse_roles(" dispatch_phased=1, combine_send_warps=5 ")
    assert roles == {"dispatch_phased": 1, "combine_send_warps": 5}
    dispatch = bench.case_config("dispatch", 4, 24, 0, 256, roles)
    combine = bench.case_config("combine", 4, 24, 0, 256, roles)
    assert dispatch.nvl_chunk_send == 48 and combine.nvl_chunk_send == 15
    assert dispatch.dispatch_phased and combine.combine_send_warps == 5  # the calls run those roles' kernel
    assert bench.parse_roles("") == {}
    for bad in ("dispatch_phased", "dispatch_phased=yes", "=3", "num_sms=3"):
        with pytest.raises(ValueError, match="is not FIELD=INTEGER"):
            bench.parse_roles(bad)


def test_rdma_message_bytes():
    """One (token, node) message of the RDMA leg, hidden 7168, top-8: the row, 8 bytes of id and weight a k and a
    16-byte header for dispatch (bf16: 2H; FP8: H + H/128 x 4 of scales); the partial row and a float32 weight a k
    for combine."""
    assert bench.rdma_message_bytes("dispatch", 7168, 8) == 14336 + 64 + 16 == 14416
    assert bench.rdma_message_bytes("dispatch-fp8", 7168, 8) == 7168 + 224 + 64 + 16 == 7472
    assert bench.rdma_message_bytes("combine", 7168, 8) == 14336 + 32 == 14368
    assert bench.rdma_message_bytes("dispatch", 4096, 6) == 8192 + 48 + 16
    assert bench.rdma_leg_bytes("dispatch", 7168, 8, 0) == 0
    assert bench.rdma_leg_bytes("dispatch-fp8", 7168, 8, 1000) == 7_472_000
    assert bench.rdma_leg_bytes("combine", 7168, 8, 3) == 3 * 14368
    with pytest.raises(ValueError, match="no RDMA message"):
        bench.rdma_message_bytes("ll-dispatch", 7168, 8)


def test_tokens_per_node_counts_a_token_once_a_node():
    """8 experts on 4 ranks (2 each), nodes of 2 ranks: experts 0-3 on node 0, 4-7 on node 1."""
    idx = np.array([[0, 3], [1, 2], [0, 5], [4, 7], [-1, 6], [-1, -1]])
    assert bench.tokens_per_node(idx, 8, 4, 2) == [3, 3]
    assert bench.tokens_per_node(idx, 8, 4, 4) == [5]  # one node: every routed token once
    assert bench.tokens_per_node(idx, 8, 4, 1) == [3, 2, 2, 2]  # a node a rank: tokens per rank
    assert bench.tokens_per_node(np.zeros((0, 2), dtype=np.int64), 8, 4, 2) == [0, 0]


def test_rdma_pairs_leave_each_rank_once_each_way():
    """2 nodes of 2 ranks, counts[r][m]: tokens of rank r bound for node m. Dispatch: a rank's tokens for the other
    node. Combine: rank (n, i) puts home what its rail peers (m, i) sent to node n."""
    counts = [[5, 7], [4, 2], [1, 9], [3, 6]]
    dispatch = [bench.rdma_pairs_out("dispatch", counts, r, 2) for r in range(4)]
    combine = [bench.rdma_pairs_out("combine", counts, r, 2) for r in range(4)]
    assert dispatch == [7, 2, 1, 3]
    assert combine == [1, 3, 7, 2]  # rank 0 returns rank 2's tokens for node 0; rank 2 returns rank 0's for node 1
    assert sum(dispatch) == sum(combine)
    assert [bench.rdma_pairs_out("dispatch", [[11]], 0, 1)] == [0]  # one node: nothing crosses


def test_role_bytes_of_two_nodes_of_two():
    """What each role of rank 0 (node 0, rank 0 of it) moves: send[s][d] rows rank s sends rank d, nodes[s][m]
    tokens of rank s for node m. Its forwarder takes the streams of rail peers 0 and 2 for node 0; its NVLink
    receivers get what ranks 1 and 3 send it through rank 1's forwarder; combine runs the same rows backwards."""
    send = [[3, 4, 5, 6], [1, 2, 7, 8], [9, 10, 11, 12], [13, 14, 15, 16]]
    nodes = [[5, 7], [4, 2], [1, 9], [3, 6]]
    dispatch = roles.role_bytes("dispatch", 0, 2, send, nodes, 100)
    assert dispatch["rdma_sender"] == roles.RoleBytes(12, 1200)  # 5 tokens in place, 7 put to node 1
    assert dispatch["forwarder"] == roles.RoleBytes(3 + 4 + 9 + 10, 2600)  # sources 0 and 2, destinations 0 and 1
    assert dispatch["nvl_receiver"] == roles.RoleBytes(1 + 13, 1400)  # sources 1 and 3, to rank 0
    combine = roles.role_bytes("combine", 0, 2, send, nodes, 50, num_tokens=20, out_row_bytes=10)
    assert combine["nvl_sender"] == roles.RoleBytes(14, 700)
    assert combine["forwarder"] == roles.RoleBytes(5 + 1, 300)  # a partial a token forwarded to node 0
    assert combine["reader"] == roles.RoleBytes(12, 200)  # its partials; out_x of its 20 tokens
    assert roles.role_bytes("dispatch", 3, 2, send, nodes, 1)["forwarder"].rows == 7 + 8 + 15 + 16  # 1, 3 to 2, 3


def test_role_table_lines():
    from epjit.ops.profile import RoleSummary

    summaries = [RoleSummary("dispatch", "rdma_sender", 12, 18, 0.0, 3.0, 900.0, 910.0, 880.0, 905.0, -1.0, 300.0),
                 RoleSummary("dispatch", "forwarder", 12, 2, 1.0, 20.0, 950.0, 955.0, 930.0, 950.0, 400.0, 10.0)]
    lines = roles.role_table(summaries, {"rdma_sender": roles.RoleBytes(1000, 910_000_000)})
    assert len(lines) == 3 and lines[0].split()[:2] == ["role", "ch"]
    assert lines[1].split()[-1] == "1000.0" and lines[1].split()[7] == "-"  # 910 MB in 910 µs; never starved
    assert lines[2].split()[-3:] == ["-", "-", "-"] and lines[2].split()[9] == "520.0"  # busy: 930 - 400 - 10


def test_rdma_pairs_of_a_random_routing_match_the_layout_count():
    """From topk_idx on the host, 4 nodes of 2: the pairs of all ranks are the routed (token, other node) pairs, the
    same total both ways."""
    rng = np.random.default_rng(7)
    num_ranks, v, experts = 8, 2, 64
    idx = [np.argsort(rng.random((50, experts)), axis=1)[:, :8] for _ in range(num_ranks)]
    counts = [bench.tokens_per_node(i, experts, num_ranks, v) for i in idx]
    nodes_of = [{int(e) // (experts // num_ranks) // v for e in row} for i in idx for row in i]
    expected = sum(len(nodes - {r // v}) for r, i in enumerate(idx) for nodes in nodes_of[r * 50:(r + 1) * 50])
    for mode in ("dispatch", "combine"):
        assert sum(bench.rdma_pairs_out(mode, counts, r, v) for r in range(num_ranks)) == expected, mode


def test_rail_peers():
    assert [bench.rail_peers(r, 4, 2) for r in range(4)] == [(2, 2), (3, 3), (0, 0), (1, 1)]
    assert [bench.rail_peers(r, 6, 2) for r in range(6)] == [(2, 4), (3, 5), (4, 0), (5, 1), (0, 2), (1, 3)]
    assert bench.rail_peers(1, 2, 1) == (0, 0)


def test_put_mode_names():
    assert [bench.put_mode_name(k << 10, 24) for k in (16, 64, 256, 1024, 4096)] == [
        "ceil-put-16k-w24", "ceil-put-64k-w24", "ceil-put-256k-w24", "ceil-put-1m-w24", "ceil-put-4m-w24"]
    assert bench.put_mode_name(1000, 1) == "ceil-put-1000b-w1"


@pytest.mark.parametrize("argv, size, message", [
    (["--num-nvl-ranks", "3"], 4, "--num-nvl-ranks 3 does not divide the 4 ranks"),
    (["--num-nvl-ranks", "16"], 32, "must be in [1, 8]"),
    (["--put-ceiling"], 4, "--put-ceiling times NVSHMEM puts between ranks of different NVLink nodes"),
    (["--put-ceiling", "--num-nvl-ranks", "4"], 4, "it needs several"),
    (["--modes", "put-ceiling"], None, "it needs several"),
    (["--modes", "ceiling", "--num-nvl-ranks", "2"], 4, "the copy ceilings are of one NVLink node"),
    (["--warp-roles", "dispatch_phased=1", "--num-nvl-ranks", "2"], 4, "--warp-roles are the intranode"),
    (["--sms", "23", "--num-nvl-ranks", "2"], 4, "two blocks a channel"),
    (["--modes", "ll-combine-logfmt", "--num-nvl-ranks", "2"], 4, "the LogFMT combine runs only where every peer"),
    (["--put-ceiling", "--num-nvl-ranks", "2", "--put-warps", "33"], 4, "--put-warps in [1, 32]"),
])
def test_internode_arguments_that_cannot_run_are_refused(argv, size, message, launched_ranks, capsys):
    if size is not None:
        launched_ranks(size)
    with pytest.raises(SystemExit) as e:
        bench.main(argv)
    assert e.value.code == 2
    assert message in capsys.readouterr().err


def test_topology_problem_once_the_ranks_are_known():
    """What main cannot check before the ranks start (no launcher variable), run checks with the group's size."""
    modes = ["dispatch", "combine"]
    assert bench.topology_problem(None, 3, modes) is None
    assert "does not divide the 4 ranks" in bench.topology_problem(4, 3, modes)
    assert bench.topology_problem(4, 2, modes, "", [24, 8]) is None
    assert bench.topology_problem(4, 4, ["ceiling", *modes], "dispatch_phased=1", [23]) is None  # one node
    assert bench.topology_problem(4, None, modes) is None
    assert bench.topology_problem(4, 2, ["put-ceiling", *modes]) is None
    assert "it needs several" in bench.topology_problem(None, None, ["put-ceiling"])


def test_put_ceiling_flag_runs_the_put_ceiling_first(launched_ranks, monkeypatch):
    launched_ranks(4)
    seen = []

    def fake_run(args):
        seen.append(args)
        raise KeyboardInterrupt  # stop before anything starts ranks

    monkeypatch.setattr(cli, "run", fake_run)
    with pytest.raises(KeyboardInterrupt):
        bench.main(["--put-ceiling", "--num-nvl-ranks", "2", "--tokens", "4096", "128"])
    (args,) = seen
    assert args.modes == ["put-ceiling", "dispatch", "dispatch-fp8", "combine"]
    assert (args.num_nvl_ranks, args.put_sms, args.put_chunks, args.put_warps) == (2, [4, 8, 16, 24],
                                                                                  [16, 64, 256, 1024], [1, 24])


def test_summary_shows_the_internode_columns(tmp_path, capsys, monkeypatch):
    """An internode row shows V, its RDMA pairs and MB, RDMA GB/s and % put; a row of an older file (without those
    fields) and an intranode row show '-' there; fields a newer file adds are skipped."""
    monkeypatch.setattr(report.print_row, "header", False, raising=False)  # printed once a process
    pairs = 40_000
    internode = bench.Row("dispatch", 4096, 7168, 8, 256, 24, 4, 400.0, 420.0, 300.0, 500.0, 280.0, 1.05, 87.0,
                          num_nvl_ranks=2, rdma_pairs=pairs, rdma_gbs=72.1, pct_put=48.5,
                          rdma_bytes=bench.rdma_leg_bytes("dispatch", 7168, 8, pairs))
    put = bench.Row("ceil-put-64k-w24", 0, 0, 0, 0, 24, 4, 450.0, None, 149.1, 149.1, None, None, 43.2,
                    num_nvl_ranks=2, rdma_bytes=(64 << 20) * 4, rdma_gbs=149.1)
    old = {k: v for k, v in asdict(bench.Row("combine", 4096, 7168, 8, 256, 24, 4, 512.5, 640.0, 310.0, 420.0, 250.0,
                                             1.25, 90.0)).items() if k not in ("num_nvl_ranks", "rdma_pairs",
                                                                                "rdma_bytes", "rdma_gbs", "pct_put")}
    path = tmp_path / "rows.json"
    path.write_text(json.dumps({"meta": {}, "rows": [asdict(internode), asdict(put), {**old, "later_field": 1}]}))
    assert bench.main(["--summary", str(path)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split()[-9:] == ["V", "RDMA", "pairs", "RDMA", "MB", "RDMA", "GB/s", "%", "put"]
    cells = {line.split()[0]: line.split() for line in lines[1:]}
    assert cells["dispatch"][-5:] == ["2", "40000", f"{pairs * 14416 / 1e6:.1f}", "72.1", "48.5"]
    assert cells["ceil-put-64k-w24"][-5:] == ["2", "-", f"{(64 << 20) * 4 / 1e6:.1f}", "149.1", "-"]
    assert cells["combine"][-5:] == ["-"] * 5


def test_intranode_cases_take_every_default_they_are_not_given():
    """0 for --sms, --chunk-send and --chunk-recv: the operation's default config's (24 SMs, 256 slots)."""
    from epjit.config import get_combine_config

    cfg = bench.case_config("combine", 4, 0, 0, 0)
    default = get_combine_config(4)
    assert (cfg.num_sms, cfg.nvl_chunk_send, cfg.nvl_chunk_recv) == (default.num_sms, default.nvl_chunk_send,
                                                                     default.nvl_chunk_recv)
    same_node = bench.case_config("combine", 4, 0, 0, 0, num_nvl_ranks=4)  # one node: the intranode defaults
    assert same_node == cfg


def test_internode_cases_take_the_internode_defaults():
    """Across NVLink nodes each case starts from get_dispatch_config / get_combine_config(ranks, num_nvl_ranks), and
    each option given replaces its field."""
    from epjit.config import get_combine_config, get_dispatch_config

    if "num_nvl_ranks" not in inspect.signature(get_dispatch_config).parameters:
        pytest.skip("epjit.config has no internode defaults yet (get_dispatch_config(num_ranks, num_nvl_ranks))")
    for mode, getter in (("dispatch", get_dispatch_config), ("dispatch-fp8", get_dispatch_config),
                         ("combine", get_combine_config)):
        default = getter(4, num_nvl_ranks=2)
        cfg = bench.case_config(mode, 4, 0, 0, 0, num_nvl_ranks=2)
        fields = ("num_sms", "nvl_chunk_send", "nvl_chunk_recv", "rdma_chunk_send", "rdma_chunk_recv")
        assert [getattr(cfg, f) for f in fields] == [getattr(default, f) for f in fields], mode
    given = bench.case_config("dispatch", 4, 0, 0, 0, num_nvl_ranks=2, rdma_chunk_send=8)
    assert given.rdma_chunk_send == 8


def test_put_ceiling_spec_matches_its_source():
    """The new kernel's spec against put_ceiling.cu (names, order, C types, as every spec in test_jit), its
    NVSHMEM link, its place among the modules `python -m epjit.jit --check` builds, and the header size shared
    with the .cu."""
    from tests.test_jit import _signature_problems, _source_of  # skips where NVRTC's bindings are missing

    spec = PutCeilingSpec()
    assert _signature_problems(spec, _source_of(spec)) == []
    assert spec.USES_NVSHMEM and any(isinstance(s, PutCeilingSpec) for s in bench_specs())
    source = (cuda_sources() / spec.SOURCE).read_text()
    (header,) = re.findall(r"constexpr int64_t kPutCeilingHeaderBytes = (\d+);", source)
    assert int(header) == PUT_CEILING_HEADER_BYTES
    assert put_ceiling_heap_bytes(64 << 20) == PUT_CEILING_HEADER_BYTES + (128 << 20)
    assert "nvshmemx_putmem_signal_nbi_warp" in source and "NVSHMEM_SIGNAL_ADD" in source
    assert "timeout_while" in source and "nvshmem_quiet" in source


def test_internode_cases_ask_the_defaults_for_their_node_size(monkeypatch):
    """Against the internode API as specified (get_*_config(num_ranks, num_nvl_ranks=V)), whether or not it has
    landed: each mode asks its own getter with the node size, and each option given replaces its field."""
    from epjit.config import Config

    asked = []

    def getter(name, chunk):
        def get(num_ranks, num_nvl_ranks=None):
            asked.append((name, num_ranks, num_nvl_ranks))
            return Config(num_sms=20, nvl_chunk_send=chunk, nvl_chunk_recv=288, rdma_chunk_send=12,
                          rdma_chunk_recv=128)
        return get

    monkeypatch.setattr(normal, "get_dispatch_config", getter("dispatch", 6))
    monkeypatch.setattr(normal, "get_combine_config", getter("combine", 4))
    fields = ("num_sms", "nvl_chunk_send", "nvl_chunk_recv", "rdma_chunk_send", "rdma_chunk_recv")
    combine = bench.case_config("combine", 8, 0, 0, 0, num_nvl_ranks=4)
    assert [getattr(combine, f) for f in fields] == [20, 4, 288, 12, 128]
    given = bench.case_config("dispatch-fp8", 8, 24, 5, 300, num_nvl_ranks=4, rdma_chunk_send=8, rdma_chunk_recv=64)
    assert [getattr(given, f) for f in fields] == [24, 5, 300, 8, 64]
    assert asked == [("combine", 8, 4), ("dispatch", 8, 4)]


def test_an_internode_buffer_is_sized_by_both_hints_over_every_case(monkeypatch):
    """The normal-mode Buffer of an internode run: the largest NVLink and RDMA hints over the cases' configs, at the
    largest hidden size, asked with the node size (against a stand-in for epjit.Buffer)."""
    import argparse

    import epjit
    from epjit.config import Config

    calls, made = [], []

    class FakeBuffer:
        @staticmethod
        def get_normal_size_hint(num_ranks, hidden, num_topk=8, num_experts=256, config=None, num_nvl_ranks=None):
            calls.append(("nvl", num_ranks, hidden, num_topk, num_experts, num_nvl_ranks))
            return 1000 * config.num_sms

        @staticmethod
        def get_rdma_size_hint(num_ranks, hidden, num_topk=8, num_experts=256, config=None, num_nvl_ranks=None):
            calls.append(("rdma", num_ranks, hidden, num_topk, num_experts, num_nvl_ranks))
            return 10 * config.rdma_chunk_recv

        def __init__(self, group, num_nvl_bytes=0, num_rdma_bytes=0):
            made.append((num_nvl_bytes, num_rdma_bytes))

    class Group:
        size, num_nvl_ranks, rank = 4, 2, 1

    monkeypatch.setattr(epjit, "Buffer", FakeBuffer)
    args = argparse.Namespace(hidden=[4096, 7168], topk=8, experts=256)
    configs = [Config(num_sms=24, rdma_chunk_recv=128), Config(num_sms=16, rdma_chunk_recv=160)]
    normal._normal_buffer(Group(), args, configs)
    assert made == [(24000, 1600)]
    assert {c[1:] for c in calls} == {(4, 7168, 8, 256, 2)}


# --------------------------------------------------------------------------------------------- peers: NCCL, DeepEP

def test_help_names_the_peers_and_the_new_modes():
    out = subprocess.run([sys.executable, "-m", "epjit.bench", "--help"], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    for word in ("--peers", "deepep", "layout-dispatch", "layout-dispatch-fp8", "cached-dispatch",
                 "cached-dispatch-fp8", "--no-nccl"):
        assert word in out.stdout, word


def _parsed(monkeypatch, argv):
    """The arguments run() would get from ``argv`` (run replaced: nothing starts)."""
    seen = []

    def fake_run(args):
        seen.append(args)
        raise KeyboardInterrupt

    monkeypatch.setattr(cli, "run", fake_run)
    with pytest.raises(KeyboardInterrupt):
        bench.main(argv)
    return seen[0]


def _fake_deep_ep(calls: list, explicit_destroy: bool = True):
    """A stand-in for DeepEP V1's module: its Buffer's class-wide num_sms and default configs as in deep_ep/buffer.py
    (set_num_sms refuses odd counts; get_*_config(num_ranks) asserts a known rank count), and every call recorded."""

    class Config:
        def __init__(self, num_sms, nvl_send, nvl_recv, rdma_send=6, rdma_recv=256):
            self.num_sms, self.nvl_send, self.nvl_recv = num_sms, nvl_send, nvl_recv

        def get_nvl_buffer_size_hint(self, hidden_bytes, num_ranks):
            return self.num_sms // 2 * num_ranks * self.nvl_recv * hidden_bytes

    class Buffer:
        num_sms = 20

        def __init__(self, group, num_nvl_bytes=0, num_rdma_bytes=0, low_latency_mode=False, num_qps_per_rank=24,
                     allow_nvlink_for_low_latency_mode=True, allow_mnnvl=False, use_fabric=False,
                     explicitly_destroy=False):
            self.explicitly_destroy = explicitly_destroy
            calls.append(("Buffer", group, num_nvl_bytes, num_rdma_bytes, low_latency_mode, num_qps_per_rank,
                          self.explicitly_destroy))

        def destroy(self):
            calls.append(("destroy", self.explicitly_destroy))

        @staticmethod
        def set_num_sms(new_num_sms):
            assert new_num_sms % 2 == 0, "The SM count must be even"
            Buffer.num_sms = new_num_sms

        @staticmethod
        def get_dispatch_config(num_ranks):
            config_map = {2: Config(Buffer.num_sms, 24, 256, 6, 128), 4: Config(Buffer.num_sms, 6, 256, 6, 128)}
            assert num_ranks in config_map, f"Unsupported number of EP ranks: {num_ranks}"
            return config_map[num_ranks]

        @staticmethod
        def get_combine_config(num_ranks):
            config_map = {2: Config(Buffer.num_sms, 10, 256, 6, 128), 4: Config(Buffer.num_sms, 9, 256, 6, 128)}
            assert num_ranks in config_map, f"Unsupported number of EP ranks: {num_ranks}"
            return config_map[num_ranks]

        @staticmethod
        def get_low_latency_rdma_size_hint(num_max_dispatch_tokens_per_rank, hidden, num_ranks, num_experts):
            return num_max_dispatch_tokens_per_rank * hidden * num_experts

        def get_dispatch_layout(self, topk_idx, num_experts):
            calls.append(("layout", num_experts))
            return "per_rank", None, "per_expert", "in_rank", "event"

        def dispatch(self, x, handle=None, num_tokens_per_rank=None, num_tokens_per_rdma_rank=None,
                     is_token_in_rank=None, num_tokens_per_expert=None, topk_idx=None, topk_weights=None,
                     config=None):
            calls.append(("dispatch", type(x).__name__, handle, num_tokens_per_rank, is_token_in_rank,
                          num_tokens_per_expert, topk_idx is not None, topk_weights, config.num_sms, config.nvl_send))
            return "recv_x", "recv_topk_idx", "recv_topk_weights", [3], "handle", "event"

        def combine(self, x, handle, topk_weights=None, config=None):
            calls.append(("combine", x, handle, topk_weights, config.num_sms, config.nvl_send))
            return "combined_x", None, "event"

        def clean_low_latency_buffer(self, num_max_dispatch_tokens_per_rank, hidden, num_experts):
            calls.append(("clean", num_max_dispatch_tokens_per_rank, hidden, num_experts))

        def low_latency_dispatch(self, x, topk_idx, num_max_dispatch_tokens_per_rank, num_experts, use_fp8=True,
                                 return_recv_hook=False):
            calls.append(("ll_dispatch", num_max_dispatch_tokens_per_rank, num_experts, use_fp8, return_recv_hook))
            return ("recv_x", "scales"), "count", "ll_handle", "event", lambda: calls.append(("dispatch hook",))

        def low_latency_combine(self, x, topk_idx, topk_weights, handle, return_recv_hook=False, use_logfmt=False):
            calls.append(("ll_combine", handle, return_recv_hook, *((x,) if use_logfmt else ())))
            if getattr(Buffer, "refuse_combine", False):
                raise RuntimeError("Failed: Assertion error csrc/deep_ep.cpp:1700 'hidden == 7168'")
            return "combined_x", "event", lambda: calls.append(("combine hook",))

    if not explicit_destroy:  # an older DeepEP: no explicitly_destroy, released by its destructor
        def init(self, group, num_nvl_bytes=0, num_rdma_bytes=0, low_latency_mode=False, num_qps_per_rank=24):
            calls.append(("Buffer", group, num_nvl_bytes, num_rdma_bytes, low_latency_mode, num_qps_per_rank))

        Buffer.__init__ = init
    module = types.ModuleType("deep_ep")
    module.Buffer, module.Config, module.__file__ = Buffer, Config, "/opt/DeepEP/deep_ep/__init__.py"
    return module


class _Group:
    """epjit's group as the peer sees it: rank 0 of ``size``; the other ranks' share of an allgather is
    ``others(obj)`` (default: the same as this rank's)."""

    def __init__(self, size=2, others=None):
        self.rank, self.size, self.others = 0, size, others or (lambda obj: obj)

    def allgather_object(self, obj):
        return [obj] + [self.others(obj) for _ in range(self.size - 1)]


@pytest.mark.parametrize("argv, expected, no_nccl", [
    ([], ["nccl"], False),
    (["--no-nccl"], [], True),
    (["--peers", "nccl", "deepep"], ["nccl", "deepep"], False),
    (["--peers", "deepep"], ["deepep"], True),
    (["--peers", "nccl", "deepep", "--no-nccl"], ["deepep"], True),
    (["--peers", "deepep", "nccl", "deepep"], ["deepep", "nccl"], False),
])
def test_peers_on_the_command_line(argv, expected, no_nccl, monkeypatch, launched_ranks):
    """--peers chooses what each case is timed beside; --no-nccl still removes NCCL. DeepEP passes the check
    here because ``deep_ep`` is a stand-in with V1's Buffer, outside epjit."""
    launched_ranks(2)
    monkeypatch.setitem(sys.modules, "deep_ep", _fake_deep_ep([]))
    args = _parsed(monkeypatch, argv)
    assert (args.peers, args.no_nccl) == (expected, no_nccl)


def test_an_unknown_peer_is_refused(capsys):
    with pytest.raises(SystemExit) as e:
        bench.main(["--peers", "mpi"])
    assert e.value.code == 2
    assert "invalid choice: 'mpi'" in capsys.readouterr().err


@pytest.mark.parametrize("module, message", [
    (None, "`import deep_ep` failed (ModuleNotFoundError"),
    ("alias", "deep_ep is epjit's own alias in this process"),
    ("inside", "inside epjit (its DeepEP-compatible API), not DeepEP"),
    ("v2", "has no Buffer.low_latency_dispatch, Buffer.clean_low_latency_buffer: not DeepEP's V1 API"),
])
def test_peers_deepep_without_deepep_is_refused_before_timing(module, message, monkeypatch, capsys, launched_ranks):
    """Each rank checks before anything is timed: DeepEP must import and be DeepEP's own V1, and the refusal says
    what to do."""
    import epjit
    import epjit.deep_ep

    launched_ranks(2)
    monkeypatch.setattr(cli, "run", lambda args: pytest.fail("a refused run started"))
    if module is None:
        monkeypatch.setitem(sys.modules, "deep_ep", None)  # `import deep_ep` raises ModuleNotFoundError
    elif module == "alias":
        monkeypatch.setitem(sys.modules, "deep_ep", sys.modules["epjit.deep_ep"])  # epjit.deep_ep.install()
    elif module == "inside":
        fake = _fake_deep_ep([])
        fake.__file__ = str(Path(epjit.__file__).parent / "deep_ep" / "__init__.py")
        monkeypatch.setitem(sys.modules, "deep_ep", fake)
    else:
        fake = _fake_deep_ep([])
        del fake.Buffer.low_latency_dispatch, fake.Buffer.clean_low_latency_buffer
        monkeypatch.setitem(sys.modules, "deep_ep", fake)
    with pytest.raises(SystemExit) as e:
        bench.main(["--peers", "nccl", "deepep"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert message in err
    assert "build DeepEP V1 from source" in err and "PYTHONPATH" in err


def test_deepep_is_not_timed_across_nvlink_nodes(launched_ranks, capsys):
    launched_ranks(4)
    with pytest.raises(SystemExit) as e:
        bench.main(["--peers", "deepep", "--num-nvl-ranks", "2"])
    assert e.value.code == 2
    assert "DeepEP is timed inside one NVLink node only" in capsys.readouterr().err
    assert bench.topology_problem(4, 4, ["dispatch"], peers=["deepep"]) is None
    assert bench.topology_problem(4, None, ["dispatch"], peers=["deepep"]) is None
    assert "one NVLink node only" in bench.topology_problem(None, 2, ["dispatch"], peers=["nccl", "deepep"])


def test_new_modes_time_their_operation():
    """layout- and cached- dispatches have their operation's bytes, NCCL peer and default config."""
    assert [bench.base_mode(m) for m in bench.NORMAL_MODES] == [
        "dispatch", "dispatch-fp8", "combine", "dispatch", "dispatch-fp8", "dispatch", "dispatch-fp8", "combine"]
    for mode in ("layout-dispatch", "cached-dispatch-fp8"):
        assert bench.case_config(mode, 2, 24, 0, 0) == bench.case_config("dispatch", 2, 24, 0, 0), mode
    assert bench.case_config("combine-fp8", 4, 24, 0, 0) == bench.case_config("combine", 4, 24, 0, 0)
    assert bench.topology_problem(4, 2, ["combine", "combine-fp8"]) is None  # across NVLink nodes too
    assert bench.case_config("combine", 2, 24, 0, 0) != bench.case_config("cached-dispatch", 2, 24, 0, 0)


def test_rows_round_trip_through_json_with_and_without_deepep():
    with_deepep = bench.Row("cached-dispatch-fp8", 4096, 7168, 8, 256, 24, 2, 400.0, 450.0, 300.0, 350.0, 260.0,
                            1.12, 87.0, num_nvl_ranks=2, deepep_us=520.0, deepep_ratio=1.3)
    without = bench.Row("dispatch", 4096, 7168, 8, 256, 24, 2, 400.0, None, 300.0, 350.0, None, None, 87.0)
    for row in (with_deepep, without):
        assert bench.Row(**json.loads(json.dumps(asdict(row)))) == row
    old = {k: v for k, v in asdict(without).items() if k not in ("deepep_us", "deepep_ratio")}  # before --peers
    assert bench.Row(**old).deepep_us is None and bench.Row(**old).deepep_ratio is None


def test_a_row_gets_deepep_figures_only_where_every_rank_has_one():
    row = bench.Row("ll-dispatch", 128, 7168, 8, 256, 0, 2, 40.0, None, 1.0, 1.0, None, None, 1.0)
    assert report.slowest([31.0, 35.5]) == 35.5
    assert report.slowest([31.0, None]) is None and report.slowest([]) is None
    assert report.with_deepep(row, None, 40.0).deepep_us is None
    assert report.with_deepep(row, 50.04, 40.0) is row
    assert (row.deepep_us, row.deepep_ratio) == (50.0, 1.25)


def test_summary_shows_deepep_columns(tmp_path, capsys, monkeypatch):
    """The table has DeepEP us and DeepEP/epjit after NCCL/epjit: a row with DeepEP's figure shows it, a row of an
    older file (no deepep fields) and a row DeepEP was not timed for show '-'."""
    monkeypatch.setattr(report.print_row, "header", False, raising=False)
    timed = bench.Row("layout-dispatch", 128, 7168, 8, 256, 24, 2, 120.0, 150.0, 10.0, 20.0, 8.0, 1.25, 3.0,
                      num_nvl_ranks=2, deepep_us=140.0, deepep_ratio=1.17)
    untimed = bench.Row("cached-dispatch", 128, 7168, 8, 256, 24, 2, 60.0, 150.0, 10.0, 20.0, 8.0, 2.5, 3.0,
                        num_nvl_ranks=2)
    old = {k: v for k, v in asdict(bench.Row("combine", 4096, 7168, 8, 256, 24, 4, 512.5, 640.0, 310.0, 420.0,
                                             250.0, 1.25, 90.0)).items() if k not in ("deepep_us", "deepep_ratio")}
    path = tmp_path / "rows.json"
    path.write_text(json.dumps({"meta": {}, "rows": [asdict(timed), asdict(untimed), old]}))
    assert bench.main(["--summary", str(path)]) == 0
    lines = capsys.readouterr().out.splitlines()
    header = lines[0].split()
    at = header.index("NCCL/epjit")
    assert header[at + 1:at + 4] == ["DeepEP", "us", "DeepEP/epjit"]
    cells = {line.split()[0]: line.split() for line in lines[1:]}
    assert cells["layout-dispatch"][10:13] == ["1.25", "140.0", "1.17"]  # NCCL/epjit, DeepEP us, DeepEP/epjit
    assert cells["cached-dispatch"][11:13] == ["-", "-"]
    assert cells["combine"][11:13] == ["-", "-"] and cells["combine"][5] == "512.5"


# --------------------------------------------------------------------------------------------- the DeepEP peer


@pytest.fixture
def fake_timing(monkeypatch):
    """The timing protocol replaced (no GPU): each timed function runs once after a ("timed", with a before-hook)
    mark in ``calls``; medians are 100, 101, ... in call order; hook halves are (7, 8)."""
    calls = []
    count = iter(range(100, 1000))

    def median_us(fn, group, repeat, warmup=5, before=None):
        if before is not None:
            before()
        calls.append(("timed", before is not None))
        fn()
        return float(next(count))

    def hook_halves_us(send_half, group, repeat, before=None):
        if before is not None:
            before()
        calls.append(("timed halves", before is not None))
        send_half().hook()
        return 7.0, 8.0

    monkeypatch.setattr(protocol, "median_us", median_us)
    monkeypatch.setattr(protocol, "graph", lambda fn, warmup=None: types.SimpleNamespace(replay=fn))
    monkeypatch.setattr(protocol, "hook_halves_us", hook_halves_us)
    return calls


def _after_mark(calls):
    """What the last timed function called."""
    marks = [i for i, c in enumerate(calls) if c[0].startswith("timed")]
    return calls[marks[-1] + 1:]


def test_deepep_normal_buffer_is_sized_by_its_hint_over_the_run(fake_timing, capsys):
    calls = fake_timing
    peer = peers.DeepEPPeer(_Group(2), deep_ep=_fake_deep_ep(calls), torch_group="WORLD")
    peer.open_normal(7168, [8, 12, 16, 24, 24])
    # the largest hint: 24 SMs (12 channels) x 2 ranks x 256 slots x 2H bytes
    assert calls == [("Buffer", "WORLD", 12 * 2 * 256 * 2 * 7168, 0, False, 24, True)]
    assert peer.deep_ep.Buffer.num_sms == 20  # the class-wide SM count is put back
    assert "DeepEP normal-mode buffer: 84.0 MiB a rank" in capsys.readouterr().out
    peer.close()
    assert calls[-1] == ("destroy", True) and peer.normal is None


@pytest.mark.parametrize("mode, timed", [
    # given the layout, as epjit's dispatch row: the dispatch alone
    ("dispatch", [("dispatch", "ndarray", None, "per_rank", "in_rank", "per_expert", True, "w", 16, 24)]),
    # with a fresh routing: the layout and the dispatch, both timed
    ("layout-dispatch-fp8", [("layout", 256),
                             ("dispatch", "tuple", None, "per_rank", "in_rank", "per_expert", True, "w", 16, 24)]),
    # the handle replayed: x alone, no layout, no top-k
    ("cached-dispatch", [("dispatch", "ndarray", "handle", None, None, None, False, None, 16, 24)]),
    # combine of the dispatched rows, with DeepEP's combine config (chunk 10 on 2 ranks)
    ("combine", [("combine", "recv_x", "handle", None, 16, 10)]),
])
def test_deepep_normal_rows_time_the_same_calls_as_epjit(mode, timed, fake_timing):
    calls = fake_timing
    peer = peers.DeepEPPeer(_Group(2), deep_ep=_fake_deep_ep(calls), torch_group="WORLD")
    peer.open_normal(7168, [16])
    x = np.zeros((64, 7168), dtype=np.float32)
    x_arg = (x.astype(np.uint8), np.ones((64, 56), dtype=np.float32)) if mode.endswith("fp8") else x
    assert peer.normal_us(mode, x_arg, np.zeros((64, 8), dtype=np.int64), "w", 256, 16, 30) == 100.0
    assert _after_mark(calls) == timed
    assert ("timed", False) in calls  # normal mode needs nothing restored between calls


def test_deepep_refusing_a_case_leaves_its_cell_empty(fake_timing, capsys):
    """An odd SM count (DeepEP's set_num_sms refuses it) gives None and one line; so does a refusal on another rank
    only: every rank takes the same decision."""
    calls = fake_timing
    peer = peers.DeepEPPeer(_Group(2), deep_ep=_fake_deep_ep(calls), torch_group="WORLD")
    peer.open_normal(7168, [23, 24])
    x, idx = np.zeros((8, 7168)), np.zeros((8, 8), dtype=np.int64)
    assert peer.normal_us("dispatch", x, idx, "w", 256, 23, 30) is None
    out = capsys.readouterr().out
    assert "DeepEP dispatch 8x7168 at 23 SMs: not timed (rank 0: AssertionError: The SM count must be even)" in out
    assert peer.deep_ep.Buffer.num_sms == 20
    peer.group.others = lambda error: error or "RuntimeError: DeepEP error: CPU recv timeout"  # rank 1 fails
    assert peer.normal_us("dispatch", x, idx, "w", 256, 24, 30) is None
    assert "(rank 1: RuntimeError: DeepEP error: CPU recv timeout)" in capsys.readouterr().out


def test_deepep_buffers_without_a_config_for_the_rank_count(fake_timing, capsys):
    calls = fake_timing
    peer = peers.DeepEPPeer(_Group(3), deep_ep=_fake_deep_ep(calls), torch_group="WORLD")
    peer.open_normal(7168, [24])
    assert peer.normal is None and not [c for c in calls if c[0] == "Buffer"]
    assert "DeepEP normal-mode Buffer: not timed (rank 0: ValueError: DeepEP has a config for none" in \
        capsys.readouterr().out
    assert peer.normal_us("dispatch", np.zeros((8, 7168)), np.zeros((8, 8)), "w", 256, 24, 30) is None


def test_deepep_low_latency_rows_replay_graphs_from_a_clean_buffer(fake_timing, monkeypatch, capsys):
    """The low-latency Buffer: DeepEP's size hint, one QP a local expert, the NIC-less defaults unless set. Each
    timed replay follows a clean of DeepEP's two buffers (a one-call graph would find its counters dirty); the hook
    halves take the hook DeepEP returns last."""
    calls = fake_timing
    monkeypatch.setenv("DEEPEP_IBGDA", "1")  # set by the user: kept
    monkeypatch.delenv("NVSHMEM_REMOTE_TRANSPORT", raising=False)
    peer = peers.DeepEPPeer(_Group(2), deep_ep=_fake_deep_ep(calls), torch_group="WORLD")
    peer.open_low_latency(256, 7168, 256)
    assert os.environ["DEEPEP_IBGDA"] == "1" and os.environ["NVSHMEM_REMOTE_TRANSPORT"] == "none"
    assert calls == [("Buffer", "WORLD", 0, 256 * 7168 * 256, True, 128, True)]
    times = peer.low_latency_us(["ll-dispatch", "ll-combine", "ll-hook"], "x", np.zeros((32, 8)), "w", "y", 30)
    assert times == {"ll-dispatch": 100.0, "ll-dispatch-send": 7.0, "ll-dispatch-recv": 8.0,
                     "ll-combine": 101.0, "ll-combine-send": 7.0, "ll-combine-recv": 8.0}
    marks = [i for i, c in enumerate(calls) if c[0].startswith("timed")]
    assert len(marks) == 4 and all(calls[i][1] and calls[i - 1] == ("clean", 256, 7168, 256) for i in marks)
    ends = [*marks[1:], len(calls)]
    timed = [[c for c in calls[i + 1:j] if c[0] != "clean"] for i, j in zip(marks, ends, strict=True)]
    assert timed == [[("ll_dispatch", 256, 256, True, False)],
                     [("ll_dispatch", 256, 256, True, True), ("dispatch hook",)],
                     [("ll_combine", "ll_handle", False)],
                     [("ll_combine", "ll_handle", True), ("combine hook",)]]
    assert "DeepEP low-latency buffer" in capsys.readouterr().out
    peer.deep_ep.Buffer.refuse_combine = True
    times = peer.low_latency_us(["ll-dispatch", "ll-combine", "ll-hook"], "x", np.zeros((32, 8)), "w", "y", 30)
    assert times["ll-dispatch"] is not None and times["ll-dispatch-send"] == 7.0
    assert times["ll-combine"] is None and times["ll-combine-send"] is None and times["ll-combine-recv"] is None
    assert "DeepEP ll-combine 32 tokens: not timed (rank 0: RuntimeError: Failed: Assertion error" in \
        capsys.readouterr().out


def test_deepep_logfmt_combine_row_times_deepeps_logfmt_on_scaled_outputs(fake_timing):
    calls = fake_timing
    peer = peers.DeepEPPeer(_Group(2), deep_ep=_fake_deep_ep(calls), torch_group="WORLD")
    peer.open_low_latency(256, 7168, 256)
    y = np.ones(4)
    times = peer.low_latency_us(["ll-combine-logfmt", "ll-hook"], "x", np.zeros((32, 8)), "w", y, 30, 0.5)
    assert times["ll-combine-logfmt"] is not None and "ll-combine-logfmt-send" not in times
    logfmt = [c for c in calls if c[0] == "ll_combine" and len(c) == 4]
    assert logfmt and all((c[3] == 0.5).all() for c in logfmt)  # DeepEP's use_logfmt=True, on y x 0.5


def test_an_older_deepep_buffer_is_released_by_dropping_it(fake_timing):
    calls = fake_timing
    peer = peers.DeepEPPeer(_Group(2), deep_ep=_fake_deep_ep(calls, explicit_destroy=False), torch_group="WORLD")
    peer.open_low_latency(128, 7168, 256)
    assert calls == [("Buffer", "WORLD", 0, 128 * 7168 * 256, True, 128)]  # no explicitly_destroy passed
    peer.close()
    assert peer.low_latency is None and not [c for c in calls if c[0] == "destroy"]


@pytest.mark.parametrize("mode, timed", [
    ("dispatch", [("dispatch", "x", "idx", "w", "layout", None, "cfg")]),
    ("dispatch-fp8", [("dispatch", "x", "idx", "w", "layout", None, "cfg")]),
    ("layout-dispatch", [("layout", "idx", 256), ("dispatch", "x", "idx", "w", "fresh layout", None, "cfg")]),
    ("cached-dispatch-fp8", [("dispatch", "x", None, None, None, "d.handle", "cfg")]),
    ("combine", [("combine", "d.x", "d.handle", "cfg")]),
])
def test_epjit_rows_time_the_same_calls_as_deepep(mode, timed):
    """epjit's call for each row: a new mode is an epjit row first, made as a user makes that call."""
    calls = []

    class Buf:
        def get_dispatch_layout(self, idx, num_experts):
            calls.append(("layout", idx, num_experts))
            return "fresh layout"

        def dispatch(self, x, topk_idx=None, topk_weights=None, layout=None, handle=None, config=None):
            calls.append(("dispatch", x, topk_idx, topk_weights, layout, handle, config))

        def combine(self, y, handle, config=None):
            calls.append(("combine", y, handle, config))

    d = types.SimpleNamespace(x="d.x", handle="d.handle")
    call = normal._epjit_call(Buf(), mode, "x", "idx", "w", "layout", d, "cfg", 256)
    assert calls == []  # nothing runs until timed
    call()
    assert calls == timed
