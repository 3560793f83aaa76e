"""The benchmark's command line without a GPU: its protocol rules hold before anything is timed; the internode
rows' RDMA-leg accounting and the put ceiling's kernel spec."""

from __future__ import annotations

import inspect
import json
import re
import subprocess
import sys
from dataclasses import asdict

import numpy as np
import pytest

from epjit import bench
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

    monkeypatch.setattr(bench, "run", fake_run)
    with pytest.raises(KeyboardInterrupt):
        bench.main(["--put-ceiling", "--num-nvl-ranks", "2", "--tokens", "4096", "128"])
    (args,) = seen
    assert args.modes == ["put-ceiling", "dispatch", "dispatch-fp8", "combine"]
    assert (args.num_nvl_ranks, args.put_sms, args.put_chunks, args.put_warps) == (2, [4, 8, 16, 24],
                                                                                  [16, 64, 256, 1024], [1, 24])


def test_summary_shows_the_internode_columns(tmp_path, capsys, monkeypatch):
    """An internode row shows V, its RDMA pairs and MB, RDMA GB/s and % put; a row of an older file (without those
    fields) and an intranode row show '-' there; fields a newer file adds are skipped."""
    monkeypatch.setattr(bench._print_row, "header", False, raising=False)  # printed once a process
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

    monkeypatch.setattr(bench, "get_dispatch_config", getter("dispatch", 6))
    monkeypatch.setattr(bench, "get_combine_config", getter("combine", 4))
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
    bench._normal_buffer(Group(), args, configs)
    assert made == [(24000, 1600)]
    assert {c[1:] for c in calls} == {(4, 7168, 8, 256, 2)}
