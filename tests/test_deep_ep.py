"""CPU tier of epjit.deep_ep, DeepEP's V1 API over epjit: install() and the module aliases, DeepEP's signatures,
Config and the size hints, how each call maps onto an epjit Buffer (a recording stand-in takes its place, so no GPU
is touched), the tuples returned, EventOverlap, and the low-latency FP8 scales in DeepEP's layout against a slow
exact reference of DeepEP's kernel's addressing. The tests that need torch skip without it and say so."""

from __future__ import annotations

import inspect
import sys
import types
from types import SimpleNamespace

import numpy as np
import pytest

import epjit.deep_ep as deep_ep_api
from epjit import ArgumentError, ArgumentTypeError, EpjitError, SetupError
from epjit.config import Config as EpjitConfig
from epjit.config import get_combine_config, get_dispatch_config
from epjit.deep_ep import Buffer, Config, EventHandle, EventOverlap, LowLatencyHandle, NormalHandle
from epjit.deep_ep import buffer as buffer_module
from epjit.kernels.intranode import intranode_min_nvl_bytes
from epjit.kernels.low_latency import low_latency_size_hint
from epjit.ops.intranode import CombineResult, DispatchResult
from epjit.ops.layout import DispatchLayout
from epjit.ops.streams import Event

REQUIRED = inspect.Parameter.empty


def needs_torch():
    return pytest.importorskip("torch", reason="torch is not installed: topk_idx_t and the FP8 scale conversion "
                                               "are not tested")


# ---------------------------------------------------------------------------------------------------- install


@pytest.fixture
def clean_modules(monkeypatch):
    """No deep_ep alias before the test, and none left after it."""
    for name in ("deep_ep", "deep_ep.utils"):
        monkeypatch.delitem(sys.modules, name, raising=False)
    yield
    deep_ep_api.uninstall()


def test_install_makes_deep_ep_and_deep_ep_utils_epjits_modules(clean_modules):
    deep_ep_api.install()
    deep_ep_api.install()  # a second call changes nothing
    import deep_ep
    from deep_ep import Buffer as B
    from deep_ep import Config as C
    from deep_ep.utils import EventHandle as H
    from deep_ep.utils import EventOverlap as O

    assert deep_ep is deep_ep_api and deep_ep_api.installed()
    assert (B, C, H, O) == (Buffer, Config, EventHandle, EventOverlap)
    assert sys.modules["deep_ep.utils"] is deep_ep_api.utils
    deep_ep_api.uninstall()
    assert "deep_ep" not in sys.modules and not deep_ep_api.installed()


def test_install_refuses_where_a_real_deep_ep_is_imported(clean_modules, monkeypatch):
    real = types.ModuleType("deep_ep")
    real.__file__ = "/site-packages/deep_ep/__init__.py"
    monkeypatch.setitem(sys.modules, "deep_ep", real)
    with pytest.raises(SetupError, match=r"a module 'deep_ep' is already imported \(/site-packages/deep_ep/"):
        deep_ep_api.install()
    assert sys.modules["deep_ep"] is real and "deep_ep.utils" not in sys.modules  # nothing changed


def test_topk_idx_t_is_int64():
    torch = needs_torch()
    assert deep_ep_api.topk_idx_t is torch.int64


# ---------------------------------------------------------------------------------------------------- signatures

# DeepEP's V1 signatures (its legacy Buffer, EventOverlap, EventHandle and the Config binding), written out here.
DEEPEP_SIGNATURES = {
    (Buffer, "__init__"): [("group", REQUIRED), ("num_nvl_bytes", 0), ("num_rdma_bytes", 0),
                           ("low_latency_mode", False), ("num_qps_per_rank", 24),
                           ("allow_nvlink_for_low_latency_mode", True), ("allow_mnnvl", False),
                           ("use_fabric", False), ("explicitly_destroy", False), ("enable_shrink", False),
                           ("comm", None)],
    (Buffer, "destroy"): [],
    (Buffer, "is_sm90_compiled"): [],
    (Buffer, "set_num_sms"): [("new_num_sms", REQUIRED)],
    (Buffer, "capture"): [],
    (Buffer, "get_low_latency_rdma_size_hint"): [("num_max_dispatch_tokens_per_rank", REQUIRED),
                                                 ("hidden", REQUIRED), ("num_ranks", REQUIRED),
                                                 ("num_experts", REQUIRED)],
    (Buffer, "get_comm_stream"): [],
    (Buffer, "get_local_buffer_tensor"): [("dtype", REQUIRED), ("size", None), ("offset", 0),
                                          ("use_rdma_buffer", False)],
    (Buffer, "get_dispatch_config"): [("num_ranks", REQUIRED)],
    (Buffer, "get_combine_config"): [("num_ranks", REQUIRED)],
    (Buffer, "get_dispatch_layout"): [("topk_idx", REQUIRED), ("num_experts", REQUIRED), ("previous_event", None),
                                      ("async_finish", False), ("allocate_on_comm_stream", False)],
    (Buffer, "dispatch"): [("x", REQUIRED), ("handle", None), ("num_tokens_per_rank", None),
                           ("num_tokens_per_rdma_rank", None), ("is_token_in_rank", None),
                           ("num_tokens_per_expert", None), ("topk_idx", None), ("topk_weights", None),
                           ("expert_alignment", 1), ("num_worst_tokens", 0), ("config", None),
                           ("previous_event", None), ("async_finish", False), ("allocate_on_comm_stream", False)],
    (Buffer, "combine"): [("x", REQUIRED), ("handle", REQUIRED), ("topk_weights", None), ("bias", None),
                          ("config", None), ("previous_event", None), ("async_finish", False),
                          ("allocate_on_comm_stream", False)],
    (Buffer, "clean_low_latency_buffer"): [("num_max_dispatch_tokens_per_rank", REQUIRED), ("hidden", REQUIRED),
                                           ("num_experts", REQUIRED)],
    (Buffer, "low_latency_dispatch"): [("x", REQUIRED), ("topk_idx", REQUIRED),
                                       ("num_max_dispatch_tokens_per_rank", REQUIRED), ("num_experts", REQUIRED),
                                       ("cumulative_local_expert_recv_stats", None),
                                       ("dispatch_wait_recv_cost_stats", None), ("use_fp8", True),
                                       ("round_scale", False), ("use_ue8m0", False), ("async_finish", False),
                                       ("return_recv_hook", False)],
    (Buffer, "low_latency_combine"): [("x", REQUIRED), ("topk_idx", REQUIRED), ("topk_weights", REQUIRED),
                                      ("handle", REQUIRED), ("use_logfmt", False), ("zero_copy", False),
                                      ("async_finish", False), ("return_recv_hook", False), ("out", None),
                                      ("combine_wait_recv_cost_stats", None)],
    (Buffer, "low_latency_update_mask_buffer"): [("rank_to_mask", REQUIRED), ("mask", False)],
    (Buffer, "low_latency_query_mask_buffer"): [("mask_status", REQUIRED)],
    (Buffer, "low_latency_clean_mask_buffer"): [],
    (Buffer, "get_next_low_latency_combine_buffer"): [("handle", REQUIRED)],
    (Config, "__init__"): [("num_sms", 20), ("num_max_nvl_chunked_send_tokens", 6),
                           ("num_max_nvl_chunked_recv_tokens", 256), ("num_max_rdma_chunked_send_tokens", 6),
                           ("num_max_rdma_chunked_recv_tokens", 256)],
    (Config, "get_nvl_buffer_size_hint"): [("hidden_bytes", REQUIRED), ("num_ranks", REQUIRED)],
    (Config, "get_rdma_buffer_size_hint"): [("hidden_bytes", REQUIRED), ("num_ranks", REQUIRED)],
    (EventHandle, "__init__"): [],
    (EventHandle, "current_stream_wait"): [],
    (EventOverlap, "__init__"): [("event", None), ("extra_tensors", None)],
    (EventOverlap, "current_stream_wait"): [("release_handle", False)],
    (EventOverlap, "register_hook_after_wait"): [("hook_after_wait", REQUIRED)],
    (EventOverlap, "__call__"): [("release_handle", False)],
}
# epjit's extensions beyond DeepEP: keyword-only, after DeepEP's parameters (docs/deep_ep.md).
EXTENSIONS = {(Buffer, "combine"): [("use_fp8", False)]}
STATIC = {"is_sm90_compiled", "set_num_sms", "capture", "get_low_latency_rdma_size_hint", "get_dispatch_config",
          "get_combine_config"}


@pytest.mark.parametrize("cls, name", list(DEEPEP_SIGNATURES), ids=lambda v: getattr(v, "__name__", v))
def test_signatures_are_deepeps(cls, name):
    params = list(inspect.signature(getattr(cls, name)).parameters.values())
    if name not in STATIC:
        assert params[0].name == "self"
        params = params[1:]
    else:
        assert isinstance(inspect.getattr_static(cls, name), staticmethod)
    extensions = [p for p in params if p.kind == p.KEYWORD_ONLY]
    params = params[:len(params) - len(extensions)]
    assert [(p.name, p.default) for p in params] == DEEPEP_SIGNATURES[(cls, name)]
    assert all(p.kind == p.POSITIONAL_OR_KEYWORD for p in params)  # DeepEP's callers pass them either way
    assert [(p.name, p.default) for p in extensions] == EXTENSIONS.get((cls, name), [])


# ---------------------------------------------------------------------------------------------------- Config


def test_config_carries_deepeps_fields_onto_epjits_config():
    c = Config(16, 8, 288, 12, 128)
    assert (c.num_sms, c.num_max_nvl_chunked_send_tokens, c.num_max_nvl_chunked_recv_tokens,
            c.num_max_rdma_chunked_send_tokens, c.num_max_rdma_chunked_recv_tokens) == (16, 8, 288, 12, 128)
    assert c.epjit == EpjitConfig(16, 8, 288, 12, 128)
    assert Config().epjit == EpjitConfig(20, 6, 256, 6, 256)  # DeepEP's defaults
    with pytest.raises(ArgumentError, match=r"Config\.nvl_chunk_recv=16 must be >= nvl_chunk_send \+ 23"):
        Config(24, 6, 16)  # DeepEP takes it; epjit's combine readers need the room (a clear error at once)
    with pytest.raises(ArgumentTypeError, match="Config.num_sms must be an int"):
        Config(24.0)


def test_size_hints_answer_for_epjits_kernels():
    for ranks in (2, 4, 8):
        for config in (Buffer.get_dispatch_config(ranks), Buffer.get_combine_config(ranks), Config()):
            hint = config.get_nvl_buffer_size_hint(7168 * 2, ranks)
            want = max(config.epjit.nvl_bytes(ranks, 7168, 32, 1024 * ranks, fp8) for fp8 in (False, True))
            assert hint == max(want, intranode_min_nvl_bytes(ranks, 128))
            # enough for what a model sends: top-8 of 256 experts, bf16 and FP8
            assert hint >= max(config.epjit.nvl_bytes(ranks, 7168, 8, 256, fp8) for fp8 in (False, True))
            assert config.get_rdma_buffer_size_hint(7168 * 2, ranks) == 0
    assert Buffer.get_low_latency_rdma_size_hint(128, 7168, 8, 256) == low_latency_size_hint(128, 7168, 8, 256)
    with pytest.raises(ArgumentError, match="hidden_bytes must be an int >= 1, got 0"):
        Config().get_nvl_buffer_size_hint(0, 8)


def test_size_hints_across_nodes_assume_deepeps_nodes_of_eight():
    """Past 8 ranks DeepEP's static hints assume nodes of 8; epjit's answer for its internode kernels with the same
    config is what a Buffer of those sizes needs, and the heap stays under DeepEP's own hint."""
    from epjit.kernels.internode import deepep_rdma_size_hint

    for ranks in (16, 32, 64):
        for config in (Config(), Config(24, 6, 256, 6, 128), Config(24, 8, 288, 8, 128)):
            nvl, rdma = config.epjit.internode_bytes(ranks, 8, 7168, 32, 1024 * ranks)
            assert config.get_nvl_buffer_size_hint(7168 * 2, ranks) == nvl
            assert config.get_rdma_buffer_size_hint(7168 * 2, ranks) == rdma > 0
            need = config.epjit.internode_bytes(ranks, 8, 7168, 8, 256)
            assert nvl >= need[0] and rdma >= need[1]  # enough for top-8 of 256
            assert rdma <= deepep_rdma_size_hint(config.num_sms // 2, ranks // 8, config.epjit.rdma_chunk_recv, 7168)
    with pytest.raises(ArgumentError, match="nodes of 8 ranks, which do not divide it"):
        Config().get_rdma_buffer_size_hint(7168 * 2, 12)


def test_default_configs_are_epjits_with_buffer_num_sms(monkeypatch):
    assert Buffer.num_sms == 24
    for ranks in (2, 4, 8):
        assert Buffer.get_dispatch_config(ranks).epjit == get_dispatch_config(ranks)
        assert Buffer.get_combine_config(ranks).epjit == get_combine_config(ranks)
    assert Buffer.get_dispatch_config(16).epjit == EpjitConfig()  # no normal mode there: hints only
    monkeypatch.setattr(Buffer, "num_sms", Buffer.num_sms)
    Buffer.set_num_sms(10)
    assert Buffer.num_sms == 10 and Buffer.get_dispatch_config(8).num_sms == 10
    for bad, error in ((0, ArgumentError), (129, ArgumentError), (8.0, ArgumentTypeError)):
        with pytest.raises(error, match="new_num_sms"):
            Buffer.set_num_sms(bad)


# ---------------------------------------------------------------------------------------------------- stand-ins


class FakeEpjitBuffer:
    """Records what each epjit call got and returns results of the right types (made from NumPy arrays)."""

    def __init__(self, group, **kwargs):
        self.group, self.kwargs, self.calls, self.closed = group, kwargs, [], False
        self.comm_stream = SimpleNamespace(ptr=1234)
        self.low_latency_hook_ran = False

    def _record(self, name, *args, **kwargs):
        self.calls.append((name, args, kwargs))

    def get_dispatch_layout(self, topk_idx, num_experts, previous_event=None, async_finish=False):
        self._record("get_dispatch_layout", topk_idx, num_experts, previous_event=previous_event,
                     async_finish=async_finish)
        n, r = topk_idx.shape[0], self.group.size
        return DispatchLayout(np.zeros(r, np.int32), None, np.zeros(num_experts, np.int32),
                              np.zeros((n, r), np.bool_), event=Event(None, 0))

    def dispatch(self, x, **kwargs):
        self._record("dispatch", x, **kwargs)
        fp8 = isinstance(x, tuple)
        return DispatchResult(np.zeros((5, 16)), np.ones((5, 1)) if fp8 else None, "recv_topk_idx",
                              "recv_topk_weights", [3, 2], "epjit-handle", Event(None, 0))

    def combine(self, y, handle, **kwargs):
        self._record("combine", y, handle, **kwargs)
        return CombineResult("combined_x", "combined_weights" if kwargs["topk_weights"] is not None else None,
                             Event(None, 0))

    def low_latency_dispatch(self, x, topk_idx, num_max, num_experts, **kwargs):
        self._record("low_latency_dispatch", x, topk_idx, num_max, num_experts, **kwargs)
        local, rows, hidden = num_experts // self.group.size, self.group.size * num_max, x.shape[1]
        handle = SimpleNamespace(src_info="src_info", layout_range="layout_range",
                                 num_max_dispatch_tokens_per_rank=num_max, hidden=hidden, num_experts=num_experts)
        scales = self.make_scales(local, rows, hidden, kwargs) if kwargs["use_fp8"] else None
        hook = None
        if kwargs["return_recv_hook"]:
            def hook():
                self.low_latency_hook_ran = True
                if scales is not None:
                    scales.add_(1)  # what the receive half writes: the copy must come after it
        return SimpleNamespace(x="recv_x", x_scales=scales, recv_count="recv_count", handle=handle,
                               event=Event(None, 0), hook=hook)

    @staticmethod
    def make_scales(local, rows, hidden, kwargs):
        torch = sys.modules["torch"]
        g = torch.Generator().manual_seed(local * rows + hidden)
        if kwargs["use_ue8m0"]:
            return torch.randint(0, 256, (local, rows, hidden // 128), dtype=torch.uint8, generator=g)
        return torch.rand((local, rows, hidden // 128), generator=g)

    def low_latency_combine(self, y, topk_idx, topk_weights, handle, **kwargs):
        self._record("low_latency_combine", y, topk_idx, topk_weights, handle, **kwargs)
        return SimpleNamespace(x="combined_x", event=Event(None, 0), hook=None)

    def get_next_low_latency_combine_buffer(self, handle):
        self._record("get_next_low_latency_combine_buffer", handle)
        if not hasattr(self, "combine_buffer"):
            r = self.group.size
            shape = (handle.num_experts // r, r * handle.num_max_dispatch_tokens_per_rank, handle.hidden)
            self.combine_buffer = np.zeros(shape, np.float32)
        return self.combine_buffer.view()  # a new object over the same memory each call, as epjit's

    def clean_low_latency_buffer(self, *args):
        self._record("clean_low_latency_buffer", *args)

    def low_latency_update_mask_buffer(self, *args):
        self._record("low_latency_update_mask_buffer", *args)

    def low_latency_query_mask_buffer(self, *args):
        self._record("low_latency_query_mask_buffer", *args)

    def low_latency_clean_mask_buffer(self):
        self._record("low_latency_clean_mask_buffer")

    def _add_low_latency(self, *sizes, **kwargs):
        self._record("_add_low_latency", *sizes, **kwargs)

    def local_memory(self, symmetric=False):  # this stand-in's "addresses": 1 << 40 (NVLink), 1 << 41 (heap)
        if symmetric:
            return 1 << 41, self.kwargs.get("num_rdma_bytes", 0) + 4096  # a heap a little larger than asked
        return 1 << 40, self.kwargs["num_nvl_bytes"]

    def close(self):
        self.closed = True
        self.closes = getattr(self, "closes", 0) + 1


@pytest.fixture
def made(monkeypatch):
    """Every epjit Buffer the DeepEP Buffer makes, in order (stand-ins), over a group of 2 ranks."""
    buffers = []

    def new(group, **kwargs):
        buffers.append(FakeEpjitBuffer(group, **kwargs))
        return buffers[-1]

    group = SimpleNamespace(rank=1, size=2, device=0, num_nvl_ranks=2)
    monkeypatch.setattr(buffer_module, "_new_epjit_buffer", new)
    original = buffer_module._make_group
    monkeypatch.setattr(buffer_module, "_make_group",
                        lambda g, comm: group if g is not None or comm is not None else original(g, comm))
    monkeypatch.setattr(Buffer, "num_sms", Buffer.num_sms)
    return buffers


def _ints(*shape):
    return np.zeros(shape, np.int64)


# ---------------------------------------------------------------------------------------------------- construction


def test_construction_makes_a_normal_buffer_or_waits_for_the_low_latency_sizes(made, monkeypatch):
    pg = object()
    b = Buffer(pg, 1 << 20, 0)
    assert (b.group, b.rank, b.group_size, b.num_nvl_bytes, b.low_latency_mode) == (pg, 1, 2, 1 << 20, False)
    assert len(made) == 1 and made[0].kwargs == {"num_nvl_bytes": 1 << 20, "num_rdma_bytes": 0}
    ll = Buffer(pg, 0, 4096, low_latency_mode=True, num_qps_per_rank=12, allow_nvlink_for_low_latency_mode=False,
                allow_mnnvl=True, use_fabric=False, explicitly_destroy=True)
    assert len(made) == 1 and ll.num_rdma_bytes == 4096  # the low-latency Buffer comes with the first call
    both = Buffer(pg, 1 << 20, 4096, low_latency_mode=True)
    assert len(made) == 2 and both._normal is made[1]
    with pytest.raises(NotImplementedError, match=r"^use_fabric=True is not available .*IPC handles, not fabric"):
        Buffer(pg, 1 << 20, use_fabric=True)
    with pytest.raises(ArgumentTypeError, match="use_fabric must be True or False"):
        Buffer(pg, 1 << 20, use_fabric="no")
    assert len(made) == 2  # refused before any epjit Buffer
    with pytest.raises(ArgumentTypeError, match="low_latency_mode must be True or False"):
        Buffer(pg, 1 << 20, low_latency_mode="False")
    monkeypatch.undo()
    with pytest.raises(ArgumentError, match="Buffer needs group .* or comm"):
        Buffer(None)


def test_across_nvlink_nodes_a_buffer_of_both_modes_is_one_epjit_buffer(made, monkeypatch):
    """Across nodes the epjit normal-mode Buffer needs the symmetric heap too: the deep_ep Buffer hands it
    num_rdma_bytes, twice over where it serves low-latency mode as well (epjit's modes lie one after the other in
    the heap, DeepEP's share it), and the first low-latency call adds low-latency mode to that same Buffer."""
    group = SimpleNamespace(rank=1, size=2, device=0, num_nvl_ranks=1)  # 2 nodes of 1
    monkeypatch.setattr(buffer_module, "_make_group", lambda g, comm: group)
    normal_only = Buffer(object(), 1 << 20, 1 << 24)
    assert made[0].kwargs == {"num_nvl_bytes": 1 << 20, "num_rdma_bytes": 1 << 24}
    both = Buffer(object(), 1 << 20, 1 << 24, low_latency_mode=True, enable_shrink=True, explicitly_destroy=True)
    assert len(made) == 2 and made[1].kwargs == {"num_nvl_bytes": 1 << 20, "num_rdma_bytes": 2 << 24}
    both.low_latency_update_mask_buffer(1, True)  # kept until low-latency mode is there
    recv_x, *_ = both.low_latency_dispatch(np.zeros((3, 256)), _ints(3, 4), 32, 8, use_fp8=False)
    assert len(made) == 2 and both._ll is both._normal is made[1] and recv_x == "recv_x"
    assert [c[0] for c in made[1].calls] == ["_add_low_latency", "low_latency_update_mask_buffer",
                                             "low_latency_dispatch"]
    assert made[1].calls[0][1:] == ((32, 256, 8), {"enable_shrink": True})
    both.clean_low_latency_buffer(32, 256, 8)
    both.get_dispatch_layout(_ints(7, 4), 16)  # normal mode, on the same epjit Buffer
    assert [c[0] for c in made[1].calls][-2:] == ["clean_low_latency_buffer", "get_dispatch_layout"]
    both.destroy()
    assert made[1].closes == 1
    small = Buffer(object(), 1 << 20, 4096, low_latency_mode=True)
    need = Buffer.get_low_latency_rdma_size_hint(32, 256, 2, 8)
    with pytest.raises(ArgumentError, match=rf"num_rdma_bytes=4096 is below the {need} bytes low-latency mode "
                                            r"needs for .* = \(32, 256, 8\) on 2 ranks"):
        small.low_latency_dispatch(np.zeros((3, 256)), _ints(3, 4), 32, 8, use_fp8=False)
    assert not made[2].calls and normal_only._one_buffer is False
    monkeypatch.setattr(group, "num_nvl_ranks", 2)  # inside one node: the low-latency Buffer apart, as before
    Buffer(object(), 1 << 20, 1 << 24, low_latency_mode=True).clean_low_latency_buffer(32, 256, 8)
    assert made[3].kwargs["num_rdma_bytes"] == 0 and made[4].kwargs["low_latency_mode"] is True


# ---------------------------------------------------------------------------------------------------- normal mode


def test_get_dispatch_layout_returns_deepeps_tuple_and_maps_events(made):
    b = Buffer(object(), 1 << 20)
    inner = made[0]
    out = b.get_dispatch_layout(_ints(7, 4), 16)
    assert len(out) == 5 and out[1] is None and out[3].shape == (7, 2)
    assert isinstance(out[4], EventOverlap) and out[4].event is None  # async_finish=False: no event, as DeepEP
    previous = Event(None, 0)
    out = b.get_dispatch_layout(_ints(7, 4), 16, previous_event=EventOverlap(EventHandle.of(previous)),
                                async_finish=True, allocate_on_comm_stream=True)
    name, args, kwargs = inner.calls[-1]
    assert (name, args[1], kwargs) == ("get_dispatch_layout", 16, {"previous_event": previous, "async_finish": True})
    assert isinstance(out[4].event, EventHandle) and isinstance(out[4].event.event, Event)
    b.get_dispatch_layout(_ints(7, 4), 16, previous_event=EventOverlap(None))
    assert inner.calls[-1][2]["previous_event"] is None
    with pytest.raises(ArgumentTypeError, match="previous_event must be an EventOverlap"):
        b.get_dispatch_layout(_ints(7, 4), 16, previous_event="event")


def test_dispatch_reads_get_dispatch_layouts_own_layout_and_returns_deepeps_tuple(made):
    b = Buffer(object(), 1 << 20)
    inner = made[0]
    per_rank, per_rdma, per_expert, in_rank, _ = b.get_dispatch_layout(_ints(7, 4), 16)
    made_layout = b._layouts[id(in_rank)]
    x, idx, w = np.zeros((7, 16)), _ints(7, 4), np.zeros((7, 4), np.float32)
    out = b.dispatch(x, num_tokens_per_rank=per_rank, num_tokens_per_rdma_rank=per_rdma, is_token_in_rank=in_rank,
                     num_tokens_per_expert=per_expert, topk_idx=idx, topk_weights=w, expert_alignment=128,
                     num_worst_tokens=64, previous_event=None, async_finish=True, allocate_on_comm_stream=True)
    name, args, kw = inner.calls[-1]
    assert name == "dispatch" and args[0] is x and kw["layout"] is made_layout  # through its addresses
    assert (kw["topk_idx"], kw["topk_weights"], kw["expert_alignment"], kw["num_worst_tokens"]) == (idx, w, 128, 64)
    assert (kw["config"], kw["previous_event"], kw["async_finish"]) == (None, None, True)
    recv_x, recv_idx, recv_w, counts, handle, event = out
    assert recv_x.shape == (5, 16) and (recv_idx, recv_w, counts) == ("recv_topk_idx", "recv_topk_weights", [3, 2])
    assert isinstance(handle, NormalHandle) and handle.handle == "epjit-handle"
    assert isinstance(event.event, EventHandle)

    # arrays that are not get_dispatch_layout's: a layout built from them, which epjit checks
    mine = (np.ones(2, np.int32), np.ones(16, np.int32), np.ones((7, 2), np.bool_))
    b.dispatch(x, num_tokens_per_rank=mine[0], num_tokens_per_expert=mine[1], is_token_in_rank=mine[2])
    layout = inner.calls[-1][2]["layout"]
    assert layout is not made_layout and layout.made is None
    assert (layout.num_tokens_per_rank, layout.num_tokens_per_expert, layout.is_token_in_rank) == mine
    with pytest.raises(ArgumentError, match="needs num_tokens_per_rank, is_token_in_rank and num_tokens_per_expert"):
        b.dispatch(x, topk_idx=idx)


def test_dispatch_fp8_returns_a_pair_and_a_handle_replays_the_routing(made):
    b = Buffer(object(), 1 << 20)
    inner = made[0]
    per_rank, per_rdma, per_expert, in_rank, _ = b.get_dispatch_layout(_ints(7, 4), 16)
    fp8 = (np.zeros((7, 128), np.uint8), np.ones((7, 1), np.float32))
    recv, *_, handle, _ = b.dispatch(fp8, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank,
                                     num_tokens_per_expert=per_expert)
    assert isinstance(recv, tuple) and len(recv) == 2
    previous = Event(None, 0)
    out = b.dispatch(fp8, handle=handle, config=Config(12, 6, 256),
                     previous_event=EventOverlap(EventHandle.of(previous)))
    name, args, kw = inner.calls[-1]
    assert kw == {"handle": "epjit-handle", "config": EpjitConfig(12, 6, 256, 6, 256), "previous_event": previous,
                  "async_finish": False}
    assert out[1:5] == (None, None, None, None) and isinstance(out[0], tuple) and out[5].event is None
    with pytest.raises(ArgumentError, match="topk_idx and topk_weights must be None"):
        b.dispatch(fp8, handle=handle, topk_idx=_ints(7, 4))
    with pytest.raises(ArgumentError, match="dispatch: handle must be the handle a dispatch of this Buffer"):
        b.dispatch(fp8, handle=("a", "tuple"))


def test_dispatch_copies_column_major_fp8_scales_row_major(made, monkeypatch):
    """DeepGEMM-style quantisers hand over scales as a column-major view; DeepEP reads them through their strides,
    epjit's kernels row-major: a row-major copy goes to epjit, ordered after previous_event where one is given."""
    torch = needs_torch()
    waits = []

    class RecordingHandle:  # EventHandle, without a GPU: records the waits and the event after the copy
        def __init__(self):
            self.event = "after the copy"

        @classmethod
        def of(cls, event):
            handle = cls.__new__(cls)
            handle.event = event
            return handle

        def current_stream_wait(self):
            waits.append(self.event)

    monkeypatch.setattr(buffer_module, "EventHandle", RecordingHandle)
    b = Buffer(object(), 1 << 20)
    inner = made[0]
    per_rank, _, per_expert, in_rank, _ = b.get_dispatch_layout(_ints(7, 4), 16)
    tokens = torch.zeros((7, 256), dtype=torch.uint8)
    scales = torch.rand((7, 2)).T.contiguous().T
    assert scales.stride() == (1, 7)
    *_, handle, _ = b.dispatch((tokens, scales), num_tokens_per_rank=per_rank, is_token_in_rank=in_rank,
                               num_tokens_per_expert=per_expert)
    sent = inner.calls[-1][1][0]
    assert sent[0] is tokens and sent[1].is_contiguous() and torch.equal(sent[1], scales)
    assert inner.calls[-1][2]["previous_event"] is None and not waits
    previous = Event(None, 0)
    b.dispatch((tokens, scales), handle=handle, previous_event=EventOverlap(EventHandle.of(previous)))
    sent, kw = inner.calls[-1][1][0], inner.calls[-1][2]
    assert sent[1].is_contiguous() and torch.equal(sent[1], scales)
    assert waits == [previous] and kw["previous_event"] == "after the copy"  # the copy after it, the call after both
    for other in (torch.rand((7, 4))[:, ::2], torch.rand((2, 7)).T[:, :1].expand(7, 2)):  # left to epjit's checks
        b.dispatch((tokens, other), handle=handle)
        assert inner.calls[-1][1][0][1] is other
    row_major = torch.rand((7, 2))
    b.dispatch((tokens, row_major), handle=handle)
    assert inner.calls[-1][1][0][1] is row_major and waits == [previous]


def test_combine_maps_onto_epjits_combine(made):
    b = Buffer(object(), 1 << 20)
    inner = made[0]
    handle = NormalHandle("epjit-handle")
    y, w, bias = np.zeros((5, 16)), np.zeros((5, 4), np.float32), (np.zeros((7, 16)), np.zeros((7, 16)))
    x, weights, event = b.combine(x=y, handle=handle, topk_weights=w, bias=bias, config=Config(20, 6, 256),
                                  async_finish=True)
    name, args, kw = inner.calls[-1]
    assert args == (y, "epjit-handle") and kw["topk_weights"] is w and kw["bias"] is bias
    assert kw["config"] == EpjitConfig(20, 6, 256, 6, 256) and kw["async_finish"] is True
    assert (x, weights) == ("combined_x", "combined_weights") and isinstance(event.event, EventHandle)
    assert b.combine(y, handle)[1] is None
    assert inner.calls[-1][2]["use_fp8"] is False
    with pytest.raises(ArgumentTypeError, match="config must be a deep_ep Config"):
        b.combine(y, handle, config={"num_sms": 20})
    # epjit's extension beyond DeepEP: the FP8 normal combine, by keyword, on both names of the method.
    for combine in (b.combine, b.internode_combine):
        combine(y, handle, use_fp8=True)
        assert inner.calls[-1][2]["use_fp8"] is True


def test_calls_without_a_config_follow_set_num_sms(made):
    b = Buffer(object(), 1 << 20)
    inner = made[0]
    b.combine(np.zeros((5, 16)), NormalHandle("h"))
    assert inner.calls[-1][2]["config"] is None  # epjit's own default: the same 24 SMs and chunks
    Buffer.set_num_sms(16)
    b.combine(np.zeros((5, 16)), NormalHandle("h"))
    assert inner.calls[-1][2]["config"] == Buffer.get_combine_config(2).epjit and Buffer.num_sms == 16
    b.dispatch(np.zeros((5, 16)), handle=NormalHandle("h"))
    assert inner.calls[-1][2]["config"].num_sms == 16


def test_deepep_configs_across_nodes_are_fitted_to_what_the_internode_kernels_run(made):
    """DeepEP's internode test tunes RDMA chunks up to 32 in NVLink rings of 512; across 2 nodes of 2, epjit's combine
    sub-rings (512 / 2) hold a chunk beyond 12 warps' RDMA chunks, so rdma_chunk_send comes down to the largest that
    runs. Inside one node, or given an epjit Config, the numbers are the caller's."""
    from epjit.deep_ep.config import fit_internode

    assert fit_internode(EpjitConfig(24, 4, 512, 24, 128), 4, 2) == EpjitConfig(24, 4, 512, 21, 128)
    assert fit_internode(EpjitConfig(24, 44, 512, 32, 128), 4, 2).rdma_chunk_send == 17
    fitting = EpjitConfig(24, 4, 512, 8, 128)
    assert fit_internode(fitting, 4, 2) is fitting
    assert fit_internode(EpjitConfig(24, 4, 512, 32, 128), 8, 1).rdma_chunk_send == 32  # nodes of 1: no ring
    EpjitConfig(24, 4, 512, 21, 128).internode_spec(4, 2)  # runs
    with pytest.raises(ArgumentError, match="combine sub-ring"):
        EpjitConfig(24, 4, 512, 22, 128).internode_spec(4, 2)
    b = Buffer(object(), 1 << 20)
    inner = made[0]
    b.combine(np.zeros((5, 16)), NormalHandle("h"), config=Config(24, 4, 512, 24, 128))
    assert inner.calls[-1][2]["config"].rdma_chunk_send == 24  # one node of 2: nothing to fit
    made.clear()
    b = Buffer(object(), 1 << 20)
    b._group = SimpleNamespace(rank=1, size=4, device=0, num_nvl_ranks=2)
    b.combine(np.zeros((5, 16)), NormalHandle("h"), config=Config(24, 4, 512, 24, 128))
    assert made[0].calls[-1][2]["config"] == EpjitConfig(24, 4, 512, 21, 128)
    b.combine(np.zeros((5, 16)), NormalHandle("h"), config=EpjitConfig(24, 4, 512, 24, 128))
    assert made[0].calls[-1][2]["config"].rdma_chunk_send == 24  # an epjit Config is taken as given


def test_normal_calls_on_a_low_latency_only_buffer_say_what_is_missing(made):
    b = Buffer(object(), 0, 1 << 20, low_latency_mode=True)
    with pytest.raises(ArgumentError, match="no NVLink buffer for normal mode"):
        b.get_dispatch_layout(_ints(7, 4), 16)
    with pytest.raises(ArgumentError, match="no NVLink buffer for normal mode"):
        b.internode_dispatch(np.zeros((5, 16)), handle=NormalHandle("h"))
    with pytest.raises(ArgumentError, match="no NVLink buffer for normal mode"):
        b.internode_combine(np.zeros((5, 16)), NormalHandle("h"))


def test_internode_calls_are_dispatch_and_combine():
    """DeepEP's dispatch() calls internode_dispatch across nodes; epjit's Buffer chooses its kernels itself."""
    assert Buffer.internode_dispatch is Buffer.dispatch and Buffer.internode_combine is Buffer.combine
    assert inspect.signature(Buffer.internode_dispatch) == inspect.signature(Buffer.dispatch)


# ---------------------------------------------------------------------------------------------------- low latency


def test_the_low_latency_buffer_is_made_at_the_first_call_with_its_sizes(made):
    b = Buffer(object(), 0, 1 << 24, low_latency_mode=True)
    x, idx = np.zeros((3, 256)), _ints(3, 4)
    recv_x, count, handle, event, hook = b.low_latency_dispatch(x, idx, 32, 8, use_fp8=False)
    assert len(made) == 1 and made[0].kwargs == {"num_rdma_bytes": 1 << 24, "low_latency_mode": True,
                                                 "num_max_dispatch_tokens_per_rank": 32, "hidden": 256,
                                                 "num_experts": 8}
    assert (recv_x, count, hook, event.event) == ("recv_x", "recv_count", None, None)
    assert isinstance(handle, LowLatencyHandle) and list(handle) == ["src_info", "layout_range", 32, 256, 8]
    src_info, layout_range, m, h, e = handle  # DeepEP's callers unpack it
    assert (handle[1], len(handle)) == ("layout_range", 5)
    b.low_latency_dispatch(x, idx, 32, 8, use_fp8=False)
    assert len(made) == 1  # the same one
    with pytest.raises(ArgumentError, match=r"set up at its first call for .* = \(32, 256, 8\); this call has "
                                            r"\(64, 256, 8\)"):
        b.low_latency_dispatch(x, idx, 64, 8, use_fp8=False)
    b.clean_low_latency_buffer(32, 256, 8)
    assert made[0].calls[-1] == ("clean_low_latency_buffer", (32, 256, 8), {})


def test_clean_low_latency_buffer_first_sets_up_low_latency_mode(made):
    b = Buffer(object(), 0, 0, low_latency_mode=True)
    b.clean_low_latency_buffer(16, 512, 4)
    assert len(made) == 1 and made[0].kwargs["num_max_dispatch_tokens_per_rank"] == 16 and not made[0].calls
    normal = Buffer(object(), 1 << 20)
    with pytest.raises(ArgumentError, match="made with low_latency_mode=False"):
        normal.low_latency_dispatch(np.zeros((3, 256)), _ints(3, 4), 32, 8)
    with pytest.raises(ArgumentError, match="no low_latency_dispatch has run on this Buffer yet"):
        normal.low_latency_combine(np.zeros(1), _ints(3, 4), np.zeros((3, 4)), None)


def test_low_latency_arguments_map_onto_epjits(made):
    b = Buffer(object(), 0, 0, low_latency_mode=True)
    x, idx, stats = np.zeros((3, 256)), _ints(3, 4), np.zeros(4, np.int32)
    waits = np.zeros(2, np.int64)
    _, _, handle, event, _ = b.low_latency_dispatch(x, idx, 32, 8, cumulative_local_expert_recv_stats=stats,
                                                    dispatch_wait_recv_cost_stats=waits, use_fp8=False,
                                                    async_finish=True)
    inner = made[0]
    name, args, kw = inner.calls[-1]
    assert args == (x, idx, 32, 8) and kw["cumulative_local_expert_recv_stats"] is stats
    assert kw["dispatch_wait_recv_cost_stats"] is waits  # the wait-stats build's (epjit checks it)
    assert (kw["use_fp8"], kw["round_scale"], kw["use_ue8m0"], kw["async_finish"], kw["return_recv_hook"]) == (
        False, False, False, True, False)
    assert isinstance(event.event, EventHandle)
    y = b.get_next_low_latency_combine_buffer(handle)
    assert inner.calls[-1] == ("get_next_low_latency_combine_buffer", (handle.handle,), {})
    w, out = np.zeros((3, 4), np.float32), np.zeros((3, 256))
    combined, event, hook = b.low_latency_combine(y, idx, w, handle, zero_copy=True, return_recv_hook=True, out=out)
    name, args, kw = inner.calls[-1]
    assert args == (y, idx, w, handle.handle)
    assert kw == {"zero_copy": True, "out": out, "return_recv_hook": True, "async_finish": False,
                  "use_logfmt": False, "combine_wait_recv_cost_stats": None}
    b.low_latency_combine(y, idx, w, handle, combine_wait_recv_cost_stats=waits)
    assert inner.calls[-1][2]["combine_wait_recv_cost_stats"] is waits
    assert (combined, event.event, hook) == ("combined_x", None, None)
    mine = np.ones((4, 64, 256), np.float32)
    b.low_latency_combine(mine, idx, w, handle)
    assert inner.calls[-1][1][0] is mine
    b.low_latency_combine(mine, idx, w, handle, use_logfmt=True)  # DeepEP's LogFMT combine: epjit's, by name
    assert inner.calls[-1][1][0] is mine and inner.calls[-1][2]["use_logfmt"] is True
    # With zero_copy too, x goes to epjit as given (no combine buffer looked up): epjit refuses the pair, as
    # DeepEP asserts.
    b.low_latency_combine(mine, idx, w, handle, use_logfmt=True, zero_copy=True)
    assert inner.calls[-1][1][0] is mine and inner.calls[-1][2]["zero_copy"] is True
    with pytest.raises(ArgumentError, match="low_latency_combine: handle must be the handle a low_latency_dispatch"):
        b.low_latency_combine(y, idx, w, ("src_info", "layout_range", 32, 256, 8))


def test_zero_copy_combine_sends_the_buffer_whatever_x_it_is_given(made):
    """DeepEP's zero_copy=True combine sends what the caller wrote into get_next_low_latency_combine_buffer's
    buffer and reads only x's shape and dtype (its own test passes the tensor it copied from)."""
    b = Buffer(object(), 0, 0, low_latency_mode=True)
    idx, w = _ints(3, 4), np.zeros((3, 4), np.float32)
    _, _, handle, _, _ = b.low_latency_dispatch(np.zeros((3, 256)), idx, 32, 8, use_fp8=False)
    inner = made[0]
    expert_outputs = np.ones((4, 64, 256), np.float32)
    b.get_next_low_latency_combine_buffer(handle)[:] = expert_outputs
    b.low_latency_combine(expert_outputs, idx, w, handle, zero_copy=True)
    (_, args, kw), fetched = inner.calls[-1], inner.calls[-2]
    assert fetched == ("get_next_low_latency_combine_buffer", (handle.handle,), {})
    assert args[0] is not expert_outputs and np.shares_memory(args[0], inner.combine_buffer) and kw["zero_copy"]
    for wrong in (np.ones((4, 64, 128), np.float32), np.ones((4, 64, 256)), "x"):
        with pytest.raises(ArgumentError, match=r"zero_copy=True sends the buffer .* x must have its shape "
                                                r"\(4, 64, 256\) and dtype float32, got"):
            b.low_latency_combine(wrong, idx, w, handle, zero_copy=True)
    with pytest.raises(ArgumentTypeError, match="zero_copy must be True or False"):
        b.low_latency_combine(expert_outputs, idx, w, handle, zero_copy="yes")


def test_what_epjit_lacks_is_refused_by_name(made):
    b = Buffer(object(), 0, 0, low_latency_mode=True)
    x, idx = np.zeros((3, 256)), _ints(3, 4)
    with pytest.raises(NotImplementedError, match="^use_fabric=True is not available in epjit's DeepEP API"):
        Buffer(object(), 1 << 20, use_fabric=True)
    for call in (lambda: b.low_latency_dispatch(x, idx, 32, 8, async_finish=True, return_recv_hook=True),
                 lambda: b.low_latency_combine(x, idx, idx, None, async_finish=True, return_recv_hook=True)):
        with pytest.raises(ArgumentError, match="async_finish=True and return_recv_hook=True cannot be combined"):
            call()
    with pytest.raises(ArgumentError, match="hidden must be a multiple of 512, got hidden=384"):
        b.low_latency_dispatch(np.zeros((3, 384)), idx, 32, 8, round_scale=True, use_ue8m0=True)
    assert not made  # refused before any kernel (or Buffer)
    with pytest.raises(ArgumentError, match="has no communication stream yet"):
        b.get_comm_stream()


def test_local_buffer_tensors_view_the_epjit_buffers_own_memory(made, monkeypatch):
    """get_local_buffer_tensor: the normal-mode Buffer's NVLink buffer, or the RDMA buffer (inside one NVLink node the
    low-latency Buffer's, once it exists), from `offset` bytes on; the view itself is made on the GPU."""
    views = []
    monkeypatch.setattr(buffer_module, "tensor_over", lambda *args: views.append(args) or "view")
    b = Buffer(object(), 1 << 20, 1 << 16, low_latency_mode=True)
    normal = made[0]
    assert b.get_local_buffer_tensor("float32", (4, 8), offset=64) == "view"
    assert views[-1] == ((1 << 40) + 64, (1 << 20) - 64, "float32", (4, 8), 0, normal)
    with pytest.raises(ArgumentError, match="inside one NVLink node this Buffer's RDMA buffer is its low-latency "
                                            "mode's, made at the first low_latency_dispatch"):
        b.get_local_buffer_tensor("uint8", use_rdma_buffer=True)
    b.low_latency_dispatch(np.zeros((3, 256)), _ints(3, 4), 32, 8, use_fp8=False)
    ll = made[1]
    b.get_local_buffer_tensor("uint8", use_rdma_buffer=True)
    assert views[-1] == (1 << 41, 1 << 16, "uint8", None, 0, ll)  # DeepEP's num_rdma_bytes, not the heap's
    with pytest.raises(ArgumentError, match=r"offset=1048577 is past the 1048576 bytes of the NVLink buffer"):
        b.get_local_buffer_tensor("int8", offset=(1 << 20) + 1)
    with pytest.raises(ArgumentError, match="offset must be an int >= 0, got -1"):
        b.get_local_buffer_tensor("int8", offset=-1)
    with pytest.raises(ArgumentTypeError, match="use_rdma_buffer must be True or False"):
        b.get_local_buffer_tensor("int8", use_rdma_buffer="yes")
    assert len(views) == 2
    only_ll = Buffer(object(), 0, 1 << 16, low_latency_mode=True)
    with pytest.raises(ArgumentError, match="no NVLink buffer for normal mode"):
        only_ll.get_local_buffer_tensor("int8")


def test_local_buffer_view_shapes_and_refusals():
    """The view's element count and shape (the CuPy view over the memory is the GPU tier's), arguments by name."""
    torch = pytest.importorskip("torch")
    from epjit.deep_ep.views import view_shape

    assert view_shape(1030, torch.int32, None) == (257, None)  # whole elements only
    assert view_shape(1024, torch.bfloat16, torch.Size([4, 8])) == (512, (4, 8))
    with pytest.raises(ArgumentError, match=r"size=\(16, 17\) needs 272 elements of torch.float32, the buffer "
                                            r"holds 256 from this offset"):
        view_shape(1024, torch.float32, (16, 17))
    with pytest.raises(ArgumentTypeError, match="dtype must be a torch.dtype, got 'float32'"):
        view_shape(1024, "float32", None)
    with pytest.raises(ArgumentTypeError, match="size must be a torch.Size or a sequence of ints, got 8"):
        view_shape(1024, torch.int8, 8)


def test_destroy_closes_both_buffers_once(made):
    b = Buffer(object(), 1 << 20, 0, low_latency_mode=True, explicitly_destroy=True)
    b.low_latency_dispatch(np.zeros((3, 256)), _ints(3, 4), 32, 8, use_fp8=False)
    normal, ll = made
    b.destroy()
    b.destroy()
    assert normal.closed and ll.closed
    with pytest.raises(EpjitError, match="was destroyed"):
        b.get_dispatch_layout(_ints(7, 4), 16)
    with pytest.raises(EpjitError, match="was destroyed"):
        b.low_latency_dispatch(np.zeros((3, 256)), _ints(3, 4), 32, 8)


# ---------------------------------------------------------------------------------------------------- events


class CountingHandle(EventHandle):
    waits = 0

    def current_stream_wait(self):
        type(self).waits += 1


def test_event_overlap_waits_as_deepeps_does(monkeypatch):
    monkeypatch.setattr(CountingHandle, "waits", 0)
    overlap = EventOverlap(CountingHandle.of(Event(None, 0)), extra_tensors=("kept",))
    assert overlap.extra_tensors == ("kept",)
    ran = []
    overlap.register_hook_after_wait(lambda: ran.append(1))
    with pytest.raises(ArgumentError, match="a hook is already registered"):
        overlap.register_hook_after_wait(lambda: None)
    with overlap:
        assert CountingHandle.waits == 0
    assert CountingHandle.waits == 1 and ran == [1]
    overlap.current_stream_wait()
    assert CountingHandle.waits == 2 and ran == [1]  # the hook runs once
    with overlap(release_handle=True):
        pass
    assert CountingHandle.waits == 3 and overlap.event is None
    with overlap:  # no event: nothing to wait for
        pass
    with pytest.raises(ArgumentError, match="holds no event: the call that returned it ran with async_finish=False"):
        overlap.current_stream_wait()
    with pytest.raises(ArgumentTypeError, match="must be an EventHandle or None"):
        EventOverlap(Event(None, 0))
    with pytest.raises(ArgumentTypeError, match="EventHandle.of needs an epjit Event"):
        EventHandle.of("event")


# ---------------------------------------------------------------------------------------------------- FP8 scales


def deepep_scale_storage(scales: np.ndarray, use_ue8m0: bool) -> np.ndarray:
    """What DeepEP's low-latency receive writes, element by element, as its kernel addresses it: scale s of token t
    of local expert e goes to (in scale_t units) e*rows*S' + t*P + (s // P)*rows*P + s % P, with P the scales a
    packed word holds (4 UE8M0 bytes an int32, 1 float) and S' the scales rounded up to P."""
    num_local, rows, groups = scales.shape
    pack = 4 if use_ue8m0 else 1
    aligned = -(-groups // pack) * pack
    out = np.zeros(num_local * rows * aligned, dtype=scales.dtype)
    for e in range(num_local):
        for t in range(rows):
            for s in range(groups):
                out[e * rows * aligned + t * pack + (s // pack) * rows * pack + s % pack] = scales[e, t, s]
    return out


@pytest.mark.parametrize("use_ue8m0", [False, True], ids=["float32", "ue8m0"])
@pytest.mark.parametrize("shape", [(1, 4, 4), (2, 8, 8), (3, 20, 56), (4, 64, 16)])
def test_scales_in_deepeps_layout_match_its_kernels_addressing_exactly(shape, use_ue8m0):
    torch = needs_torch()
    from epjit.deep_ep.scales import deepgemm_scales

    g = torch.Generator().manual_seed(sum(shape))
    if use_ue8m0:
        scales = torch.randint(0, 256, shape, dtype=torch.uint8, generator=g)
    else:
        scales = torch.rand(shape, generator=g) * 2.0 ** torch.randint(-20, 20, shape, generator=g)
    out = deepgemm_scales(scales, use_ue8m0)
    num_local, rows, groups = shape
    packed = groups // 4 if use_ue8m0 else groups
    assert out.dtype == (torch.int32 if use_ue8m0 else torch.float32)
    assert tuple(out.shape) == (num_local, rows, packed)
    assert out.stride() == (packed * rows, 1, rows)  # column-major in the last two dimensions, as DeepEP's
    storage = out.transpose(1, 2).contiguous().flatten()  # the elements in memory order
    want = deepep_scale_storage(scales.numpy(), use_ue8m0)
    got = storage.view(torch.uint8).numpy() if use_ue8m0 else storage.numpy()
    assert got.tobytes() == want.tobytes()
    if use_ue8m0:  # and each int32 holds exponents 4g..4g+3, the first in its low byte (DeepGEMM's reading)
        word = int(out[0, rows - 1, packed - 1]) & 0xFFFFFFFF
        assert [(word >> (8 * j)) & 0xFF for j in range(4)] == scales[0, rows - 1, groups - 4:].tolist()
    else:
        assert torch.equal(out, scales)


def test_scales_conversion_refuses_what_it_cannot_pack():
    torch = needs_torch()
    from epjit.deep_ep.scales import deepgemm_scales

    with pytest.raises(ArgumentError, match="hidden must be a multiple of 512, got hidden=768"):
        deepgemm_scales(torch.zeros((1, 4, 6), dtype=torch.uint8), True)
    with pytest.raises(ArgumentTypeError, match="scales of type ndarray"):
        deepgemm_scales(np.zeros((1, 4, 4), np.float32), False)


@pytest.mark.parametrize("use_ue8m0", [False, True], ids=["float32", "ue8m0"])
def test_low_latency_fp8_dispatch_returns_deepeps_scales(made, use_ue8m0):
    torch = needs_torch()
    from epjit.deep_ep.scales import deepgemm_scales

    b = Buffer(object(), 0, 0, low_latency_mode=True)
    x, idx = torch.zeros((3, 512)), torch.zeros((3, 4), dtype=torch.int64)
    (recv_x, scales), count, _, event, hook = b.low_latency_dispatch(x, idx, 32, 8, round_scale=use_ue8m0,
                                                                     use_ue8m0=use_ue8m0)
    epjit_scales = FakeEpjitBuffer.make_scales(4, 64, 512, {"use_ue8m0": use_ue8m0})
    assert recv_x == "recv_x" and hook is None and event.event is None
    assert torch.equal(scales, deepgemm_scales(epjit_scales, use_ue8m0)) and scales.stride() == (64 * scales.shape[2],
                                                                                                  1, 64)

    # With the receive hook the scales are valid after it: the copy runs in the hook, after the receive half.
    (_, scales), _, _, _, hook = b.low_latency_dispatch(x, idx, 32, 8, round_scale=use_ue8m0, use_ue8m0=use_ue8m0,
                                                        return_recv_hook=True)
    assert not made[0].low_latency_hook_ran
    hook()
    assert made[0].low_latency_hook_ran
    assert torch.equal(scales, deepgemm_scales(epjit_scales.add_(1), use_ue8m0))


# ---------------------------------------------------------------------------------------------------- handles


def _handle_ints(arrays):
    """epjit's handle arrays as Ints in one int32 allocation (NumPy here, CuPy on a GPU), in the given order."""
    from epjit.ops.normal import Ints

    flat = [np.asarray(a, np.int32) for a in arrays]
    owner = np.concatenate([a.reshape(-1) for a in flat])
    offsets = np.cumsum([0] + [a.size for a in flat])[:-1]
    return tuple(Ints(owner, int(o), a.shape, 0) for o, a in zip(offsets, flat, strict=True))


def test_the_intranode_handle_is_deepeps_six_tuple():
    torch = needs_torch()
    from epjit.ops.normal import DispatchHandle

    counts = np.array([[1, 2], [3, 0]])  # [src, dst] tokens
    rank_prefix = np.cumsum(counts, axis=0)
    channel_prefix, recv_offset = np.array([[0, 1], [1, 2]]), np.array([[0, 0], [1, 2]])
    send_head = np.array([[0, -1], [-2, 1], [1, -3]])  # epjit's -(next)-1 where a token was not sent
    recv_src = np.array([2, 0, 1, 2, 9])  # one row more than received: a worst-token handle's capacity
    in_rank = np.array([[True, False], [False, True], [True, True]])
    ints = _handle_ints([rank_prefix, channel_prefix, recv_offset, send_head, recv_src, [0]])
    h = NormalHandle(DispatchHandle(ints, 0, in_rank, 4, 4, plan=None))
    assert len(h) == 6 and h.names()[0] == "rank_prefix_matrix"
    rpm, cpm, rcpm, src_idx, itr, head = h  # unpacks as DeepEP's
    assert rpm is h[0] and h[-1] is head  # made once, on the first read
    assert rpm.tolist() == [[1, 2], [4, 2]] and rpm.dtype == torch.int32
    assert cpm.tolist() == channel_prefix.tolist() and rcpm.tolist() == recv_offset.tolist()
    assert src_idx.tolist() == [2, 0, 1, 2]
    assert itr.tolist() == in_rank.tolist()
    assert head.tolist() == [[0, -1], [-1, 1], [1, -1]]  # DeepEP's dispatch leaves -1 where nothing was sent
    assert h[0:2] == (rpm, cpm)


def test_the_internode_handle_is_deepeps_ten_tuple():
    torch = needs_torch()
    from epjit.ops.internode import HANDLE_INTS, InternodeHandle

    # 2 nodes, 2 channels, 4 ranks; rows received from the ranks 3, 1, 0, 2; forwarded tokens per (node, channel).
    arrays = {
        "channel_prefix_matrix": [[1, 2], [0, 1], [2, 2], [1, 3]],
        "rdma_channel_prefix": [[1, 3], [3, 5]],
        "recv_rank_prefix": [0, 3, 4, 4, 6],
        "fwd_node_prefix": [0, 5],
        "recv_channel_offset": [[0, 1], [3, 3], [4, 4], [4, 5]],
        "recv_channel_count": [[1, 2], [0, 1], [0, 0], [1, 1]],
        "send_rdma_head": [[0, -1], [-1, 0], [1, 1]],
        "recv_rdma_channel": [[[0, 2], [2, 3]], [[5, 1], [6, 3]]],  # first forwarded index, count
        "send_nvl_head": [[0, -2]] * 9,
        "recv_src_idx": [0] * 6,
        "status": [0],
        "saved_counts": [0] * 8,
    }
    in_rank = np.ones((3, 4), bool)
    ints = _handle_ints([arrays[name] for name in HANDLE_INTS])
    h = NormalHandle(InternodeHandle(ints, 0, in_rank, 6, 6, plan=None, num_forwarded=9))
    assert len(h) == 10 and h.names()[-4] == "recv_gbl_rank_prefix_sum"
    (itr, rdma_cpm, gbl_cpm, recv_rdma_cpm, recv_rdma_prefix, recv_gbl_cpm, recv_gbl_prefix, src_meta, rdma_head,
     nvl_head) = h
    assert itr.tolist() == in_rank.tolist()
    assert rdma_cpm.tolist() == arrays["rdma_channel_prefix"] and gbl_cpm.tolist() == arrays["channel_prefix_matrix"]
    assert recv_rdma_cpm.tolist() == [[2, 5], [1, 4]] and recv_rdma_cpm.dtype == torch.int32  # end, in its node's
    assert recv_rdma_prefix.tolist() == [5, 9] and recv_rdma_prefix.dtype == torch.int32  # inclusive over nodes
    assert recv_gbl_cpm.tolist() == arrays["recv_channel_offset"]
    assert h[-4] is recv_gbl_prefix and recv_gbl_prefix.tolist() == [3, 4, 4, 6]  # inclusive over source ranks
    assert src_meta is None  # no counterpart in epjit (docs/deep_ep.md)
    assert rdma_head.tolist() == [[0, -1], [-1, 0], [1, 1]] and nvl_head.tolist() == [[0, -1]] * 9


def test_install_passes_its_node_size_to_the_group(clean_modules, monkeypatch):
    seen = []
    monkeypatch.setattr("epjit.group.init", lambda **kw: seen.append(kw) or "group")
    deep_ep_api.install(num_nvl_ranks=2)
    assert buffer_module._make_group("torch-group", None) == "group"
    deep_ep_api.uninstall()
    buffer_module._make_group(None, "comm")
    assert seen == [{"torch_group": "torch-group", "num_nvl_ranks": 2}, {"comm": "comm", "num_nvl_ranks": None}]


def test_shrink_mode_reaches_the_low_latency_buffer_with_deepeps_mask_calls(made):
    b = Buffer(object(), 0, 1 << 24, low_latency_mode=True, enable_shrink=True)
    assert b.enable_shrink is True
    b.low_latency_update_mask_buffer(1, True)  # before the low-latency Buffer exists: kept for it
    with pytest.raises(ArgumentError, match="rank_to_mask=2 is not a rank of this Buffer's 2"):
        b.low_latency_update_mask_buffer(2, True)
    with pytest.raises(ArgumentError, match="no low_latency_dispatch has run"):
        b.low_latency_query_mask_buffer("mask_status")
    b.low_latency_dispatch(np.zeros((3, 256)), _ints(3, 4), 32, 8, use_fp8=False)
    assert made[0].kwargs["enable_shrink"] is True
    assert made[0].calls[0] == ("low_latency_update_mask_buffer", (1, True), {})
    b.low_latency_query_mask_buffer("mask_status")
    b.low_latency_update_mask_buffer(0)
    b.low_latency_clean_mask_buffer()
    assert [c[:2] for c in made[0].calls[-3:]] == [("low_latency_query_mask_buffer", ("mask_status",)),
                                                   ("low_latency_update_mask_buffer", (0, False)),
                                                   ("low_latency_clean_mask_buffer", ())]
    plain = Buffer(object(), 0, 1 << 24, low_latency_mode=True)
    for call, args in (("low_latency_update_mask_buffer", (0, True)), ("low_latency_query_mask_buffer", ("m",)),
                       ("low_latency_clean_mask_buffer", ())):
        with pytest.raises(ArgumentError, match=f"^{call} needs a Buffer made with enable_shrink=True"):
            getattr(plain, call)(*args)
