"""CPU tier: Config validation, the default configs and the NVLink size hints (host mirror of the kernel layout)."""

from __future__ import annotations

import re

import numpy as np
import pytest

from epjit import ArgumentError, ArgumentTypeError, Config
from epjit.config import (
    COMBINE_READERS,
    MAX_CHANNELS,
    get_combine_config,
    get_dispatch_config,
    normal_size_hint,
)
from epjit.kernels import cuda_sources
from epjit.kernels.intranode import (
    CLAIMS_INTS,
    META_COMPARED,
    META_INTS,
    NUM_THREADS,
    IntranodeSpec,
    intranode_min_nvl_bytes,
    intranode_nvl_bytes,
    intranode_spec,
    normal_grid,
)
from epjit.ops import notify as ops

CUDA_SRC = cuda_sources()


def test_config_rejects_what_would_deadlock_or_not_launch():
    with pytest.raises(ArgumentError, match=r"num_sms=0 must be in \[1, 128\]"):
        Config(num_sms=0)
    with pytest.raises(ArgumentError, match=r"num_sms=129 must be in \[1, 128\]"):
        Config(num_sms=129)
    with pytest.raises(ArgumentError, match="nvl_chunk_send=0"):
        Config(nvl_chunk_send=0)
    with pytest.raises(ArgumentError, match=rf"nvl_chunk_recv=20 must be >= nvl_chunk_send \+ {COMBINE_READERS}"):
        Config(24, 6, 20)
    assert Config(23, 6, 6 + COMBINE_READERS).num_channels == 23  # one block a channel, any count


@pytest.mark.parametrize("ranks", [2, 4, 8])
def test_defaults_are_valid_and_share_channels(ranks):
    d, c = get_dispatch_config(ranks), get_combine_config(ranks)
    spec = intranode_spec(ranks)
    assert d.num_sms <= 24 and d.num_channels == c.num_channels
    # Combine readers wait for whole chunks (18 rows cost 2 x H200 ~40 us): ~12 rows, whole rows a sending warp.
    assert c.nvl_chunk_send == {2: 14, 4: 12, 8: 12}[ranks]
    assert c.nvl_chunk_send % spec.combine_send_warps == 0
    # Dispatch: four tokens a sending warp between tail updates (2 x H200: FP8 158.6 -> 149.0 us with 32, not 16).
    assert d.nvl_chunk_send == max(12, 4 * spec.dispatch_send_warps)
    assert d.nvl_chunk_recv >= d.nvl_chunk_send + COMBINE_READERS


def test_default_warp_roles():
    """The measured roles (kernels/intranode.py): dispatch senders get what the own copy and the drain groups leave,
    combine's senders, coordinator and readers fill the block; the kernel takes them as template parameters."""
    roles = {r: intranode_spec(r) for r in (1, 2, 4, 8)}
    assert [(s.dispatch_send_warps, s.dispatch_drain_warps) for s in roles.values()] == [(0, 0), (10, 8), (4, 3),
                                                                                         (2, 1)]
    assert [s.combine_send_warps for s in roles.values()] == [0, 7, 4, 2]
    warps = NUM_THREADS // 32
    for r, s in roles.items():
        assert warps - (r - 1) * (s.dispatch_send_warps + s.dispatch_drain_warps) == {1: 24, 2: 6, 4: 3, 8: 3}[r]
        assert (r - 1) * s.combine_send_warps + 1 < warps  # a coordinator and at least one reader remain
    assert f"kMaxChannels = {MAX_CHANNELS};" in (CUDA_SRC / "channels.cuh").read_text()


def test_warp_roles_are_config_fields_and_their_chunks():
    """Config's warp-role fields: a phased dispatch sends with one group of every sending warp, and its chunks grow
    with the group (four tokens a warp); combine's chunks stay whole rows a sending warp."""
    config = Config(dispatch_phased=True, combine_send_warps=3)
    assert config.roles() == {"combine_send_warps": 3, "dispatch_phased": 1} and not Config().roles()
    phased = config.spec(4)
    assert phased == intranode_spec(4, dispatch_phased=1, combine_send_warps=3)
    assert Config().spec(4) == intranode_spec(4)
    assert phased.dispatch_phased and phased.dispatch_group_send_warps == 12
    assert get_dispatch_config(4, phased).nvl_chunk_send == 48
    assert get_combine_config(4, phased).nvl_chunk_send == 12
    assert get_combine_config(4, intranode_spec(4, combine_send_warps=5)).nvl_chunk_send == 15
    assert "dispatch_phased=true" in phased.family and "combine_send_warps=3" in phased.family
    assert hash(config) == hash(Config(dispatch_phased=True, combine_send_warps=3)) and config != Config()
    with pytest.raises(ValueError, match="no tunable field"):
        intranode_spec(4, num_ranks=2)
    with pytest.raises(ValueError, match="cannot form the dispatch groups"):
        Config(dispatch_send_warps=6).spec(4)  # 3 x (6 + 3) = 27 warps of 24
    with pytest.raises(ValueError, match="cannot hold 8 combine sending warps"):
        intranode_spec(4, combine_send_warps=8)
    with pytest.raises(ValueError, match="one rank has no peer"):
        IntranodeSpec(1, NUM_THREADS, 1, 0, 0, False)
    with pytest.raises(ArgumentError, match=r"Config.combine_send_warps=-1 must be >= 0"):
        Config(combine_send_warps=-1)
    with pytest.raises(ArgumentTypeError, match=r"Config.num_sms must be an int, got '24'"):
        Config("24")  # type: ignore[arg-type]


def test_config_numbers_are_ints_and_its_flag_a_bool():
    """A float, a bool or None is no count (a NumPy integer is, and is kept as the int it is); a flag given as text
    would be truthy whatever it says."""
    for name, value in (("nvl_chunk_send", 6.0), ("nvl_chunk_recv", None), ("num_sms", True),
                        ("rdma_chunk_recv", np.float64(128)), ("combine_send_warps", np.array([2]))):
        with pytest.raises(ArgumentTypeError, match=rf"^Config\.{name} must be an int, got "):
            Config(**{name: value})
    config = Config(num_sms=np.int64(8), nvl_chunk_send=np.array(6), dispatch_phased=np.True_)
    assert type(config.num_sms) is int and type(config.nvl_chunk_send) is int and config.dispatch_phased is True
    assert config == Config(num_sms=8, dispatch_phased=True) and hash(config) == hash(Config(8, dispatch_phased=True))
    with pytest.raises(ArgumentTypeError, match=r"^Config\.dispatch_phased must be True or False, got 'no'$"):
        Config(dispatch_phased="no")  # type: ignore[arg-type]


def test_default_configs_and_size_hints_refuse_what_is_not_a_count():
    """get_*_config and the hints name the argument that is not an int, or out of range, before computing."""
    from epjit import Buffer

    for call, message in (
        (lambda: get_dispatch_config("4"), r"num_ranks must be an int >= 1, got '4'"),
        (lambda: get_combine_config(0), r"num_ranks must be an int >= 1, got 0"),
        (lambda: get_dispatch_config(9), r"num_ranks=9: .*cannot form the dispatch groups .*"),
        (lambda: Config().spec(4.0), r"num_ranks must be an int >= 1, got 4.0"),
        (lambda: Buffer.get_normal_size_hint(4, "7168"), r"hidden must be an int >= 1, got '7168'"),
        (lambda: Buffer.get_normal_size_hint(4, 7168, 8.0), r"num_topk must be an int >= 0, got 8.0"),
        (lambda: normal_size_hint(4, 7168, 8, None), r"num_experts must be an int >= 0, got None"),
        (lambda: normal_size_hint(2.5, 7168), r"num_ranks must be an int >= 1, got 2.5"),
        (lambda: normal_size_hint(4, 7168, config={"num_sms": 24}), r"config must be an epjit.Config, got dict"),
        (lambda: Buffer.get_low_latency_size_hint("128", 7168, 8, 256),
         r"num_max_dispatch_tokens_per_rank must be an int >= 1, got '128'"),
        (lambda: Buffer.get_low_latency_size_hint(128, 7168.5, 8, 256), r"hidden must be an int >= 1, got 7168.5"),
        (lambda: Buffer.get_low_latency_size_hint(128, 7168, 8, 0), r"num_experts must be an int >= 1, got 0"),
    ):
        with pytest.raises((ArgumentError, ArgumentTypeError), match=f"^{message}$"):
            call()
    assert Buffer.get_low_latency_size_hint(np.int64(128), 7168, np.array(8), 256) == \
        Buffer.get_low_latency_size_hint(128, 7168, 8, 256)
    assert Buffer.get_normal_size_hint(np.int32(4), 7168) == Buffer.get_normal_size_hint(4, 7168)


def test_buffer_for_4096x7168_default_config_is_at_most_1_gib():
    hint = normal_size_hint(4, 7168, 8, 256)
    assert hint <= 1 << 30, hint
    # The rings dominate: channels x ranks x slots x row bytes.
    cfg = get_dispatch_config(4)
    assert hint >= cfg.num_channels * 4 * cfg.nvl_chunk_recv * 7168 * 2


def test_size_formula_matches_the_device_layout_regions():
    """intranode_nvl_bytes must add exactly the regions IntranodeLayout's constructor advances over, in order."""
    header = (CUDA_SRC / "intranode.cuh").read_text()
    body = re.search(r"IntranodeLayout\(void\* payload.*?end = off;", header, re.S).group(0)
    regions = re.findall(
        r"^\s*(\w+) = (?:reinterpret_cast<[^>]+>\()?base \+ off\)?, off \+= align128\((.*)\);$", body, re.M
    )
    names = [name for name, _ in regions]
    assert names == [
        "dispatch_ctrl",
        "combine_ctrl",
        "counts",
        "meta",
        "ring_x",
        "ring_src",
        "ring_topk_idx",
        "ring_topk_weights",
        "ring_scales",
        "expert_counts",
    ]
    # Evaluate the C expressions with Python for one set of sizes and compare with the Python mirror.
    env = {"R": 4, "C": 12, "T": 256, "K": 8, "row_bytes": 7168 * 2, "num_scales": 56, "num_local_experts": 64,
           "kMetaInts": META_INTS}
    total = sum((eval(expr, {}, env) + 127) // 128 * 128 for _, expr in regions)  # noqa: S307 - our own header
    assert total == intranode_nvl_bytes(4, 12, 256, 7168, 8, 56, 64)


def test_notify_meta_and_status_mirror_the_kernel():
    """The host reads notify's meta and status words with the layout and bits intranode.cuh and status.cuh define
    (the normal-mode families' public protocol constants, epjit.ops.notify)."""
    header, source = (CUDA_SRC / "intranode.cuh").read_text(), (CUDA_SRC / "status.cuh").read_text()
    assert f"kMetaInts = {META_INTS};" in header and f"kMetaCompared = {META_COMPARED};" in header
    for name, value in (("kStatusMetaMismatch", ops.STATUS_META_MISMATCH),
                        ("kStatusWorstTooSmall", ops.STATUS_WORST_TOO_SMALL),
                        ("kStatusLayoutTooBig", ops.STATUS_LAYOUT_TOO_BIG),
                        ("kStatusInvalidIds", ops.STATUS_INVALID_IDS),
                        ("kStatusOverCapacity", ops.STATUS_OVER_CAPACITY),
                        ("kFlagWorstTokens", ops.FLAG_WORST_TOKENS),
                        ("kFlagCaptured", ops.FLAG_CAPTURED)):
        assert re.search(rf"constexpr int {name} = {value};", source), name
    assert len(ops.META_NAMES) == META_COMPARED


def test_minimum_covers_control_words_counts_and_meta():
    assert intranode_min_nvl_bytes(8, 64) == intranode_nvl_bytes(8, 64, 0, 0, 0, 0, 0)
    assert intranode_min_nvl_bytes(8, 64) >= (6 * 64 * 8 + 8 * 8 + 8 * 4) * 4


def test_normal_grid_launches_spare_blocks_for_the_channel_claims():
    """Twice the channels, so every channel can find a block alone on its TPC; capped by the SMs, never below the
    channels (a block a channel is what the kernels need)."""
    assert normal_grid(24, 132) == 48
    assert normal_grid(100, 132) == 132
    assert normal_grid(128, 120) == 128
    source = (CUDA_SRC / "placement.cuh").read_text()
    assert "ptx::smid() / 2" in source  # a TPC is SMs 2k and 2k + 1
    assert f"kMaxTpcs = {CLAIMS_INTS - 2};" in source  # the host allocates next, arrived, tpc_taken[kMaxTpcs]


def test_buffer_sizes_must_be_integers_named():
    """A size given as text or a float is refused naming the argument, before any collective or GPU work."""
    from epjit import Buffer
    from epjit.group import Group

    group = object.__new__(Group)  # is a Group; never asked anything: the sizes are checked first
    for name, value in (("num_nvl_bytes", "1GB"), ("num_rdma_bytes", 1.5), ("num_experts", True),
                        ("num_max_dispatch_tokens_per_rank", None), ("hidden", np.array(7168.0))):
        with pytest.raises(ArgumentTypeError, match=rf"Buffer\({name}=\.\.\.\) must be an int >= 0, got"):
            Buffer(group, **{name: value})
    with pytest.raises(ArgumentError, match=r"^Buffer\(hidden=\.\.\.\) must be an int >= 0, got -1$"):
        Buffer(group, hidden=-1)  # an int, but no size
    with pytest.raises(ArgumentTypeError,
                       match=r"^Buffer\(low_latency_mode=\.\.\.\) must be True or False, got 'False'$"):
        Buffer(group, low_latency_mode="False")  # truthy: it would have made a low-latency Buffer
