"""CPU tier: number (and flag) arguments of the public calls. A non-integer is refused naming the argument and
showing the value, before any plan is looked up, any kernel runs or any GPU memory is touched; an integer of
another type (NumPy's, a 0-d integer array) is taken as the int it is."""

from __future__ import annotations

import dataclasses
import enum
from types import SimpleNamespace

import numpy as np
import pytest

from epjit import ArgumentError, ArgumentTypeError, Buffer, Config
from epjit.errors import EpjitError, check_flag, check_int, set_rank
from epjit.front.common import Plans
from epjit.front.low_latency import LowLatencyFront
from epjit.front.normal import IntranodeFront
from epjit.launch import launch

NOT_INTS = ["8", 8.0, 8.5, None, True, np.True_, np.float32(8), np.array(8.0), np.array([8]), np.array(True), [8],
            object()]


class _Eight(enum.IntEnum):
    EIGHT = 8


@pytest.mark.parametrize("value", NOT_INTS, ids=repr)
def test_check_int_refuses_what_is_not_an_integer_naming_it(value):
    with pytest.raises(ArgumentTypeError) as e:
        check_int(value, "num_worst_tokens")
    assert str(e.value) == f"num_worst_tokens must be an int >= 0, got {value!r}"


def test_check_int_takes_integers_of_any_kind_as_ints():
    for value in (8, np.int64(8), np.uint8(8), np.int32(8), np.array(8), np.array(8, dtype=np.int16), _Eight.EIGHT):
        got = check_int(value, "x", 1)
        assert got == 8 and type(got) is int, (value, got)
    with pytest.raises(ArgumentError, match=r"^expert_alignment must be an int >= 1, got 0$"):
        check_int(0, "expert_alignment", 1)
    with pytest.raises(ArgumentError, match=r"^hidden must be an int >= 0, got np\.int64\(-1\)$"):
        check_int(np.int64(-1), "hidden")
    assert check_int(-5, "offset", None) == -5  # no bound
    with pytest.raises(ArgumentTypeError, match=r"^x must be an int, got '1'$"):
        check_int("1", "x", None)
    set_rank(3)
    try:
        with pytest.raises(ArgumentTypeError, match=r"^x must be an int >= 0, got 1\.5 \(rank 3\)$"):
            check_int(1.5, "x")
    finally:
        set_rank(None)


def test_check_int_takes_torch_integer_scalars_only():
    torch = pytest.importorskip("torch")
    for value in (torch.tensor(8), torch.tensor(8, dtype=torch.int32)):
        got = check_int(value, "x")
        assert got == 8 and type(got) is int, value
    for value in (torch.tensor(8.0), torch.tensor(True), torch.tensor([8]), torch.tensor([8, 9])):
        with pytest.raises(ArgumentTypeError, match=r"^x must be an int >= 0, got tensor\("):
            check_int(value, "x")
    assert check_flag(torch.tensor(True), "f") is True
    with pytest.raises(ArgumentTypeError, match=r"^f must be True or False, got tensor\("):
        check_flag(torch.tensor([True, False]), "f")


def test_check_flag():
    for value, expected in ((True, True), (False, False), (np.True_, True), (np.False_, False), (1, True), (0, False),
                            (np.array(True), True)):
        assert check_flag(value, "use_fp8") is expected, value
    for value in ("False", "True", None, 2, np.array([True, False]), [True]):
        with pytest.raises(ArgumentTypeError) as e:
            check_flag(value, "use_fp8")
        assert str(e.value) == f"use_fp8 must be True or False, got {value!r}"


# --------------------------------------------------------------------------------------------------------------
# Buffer calls, on a Buffer with no GPU, memory or kernels behind it
# --------------------------------------------------------------------------------------------------------------


class _Looked(Exception):
    def __init__(self, key: tuple) -> None:
        super().__init__(key)
        self.key = key


class _Plans(dict):
    """A plan cache that stops the call at its first look-up: a check that raises first ran before it."""

    def get(self, key, default=None):
        raise _Looked(key)


def _hollow(num_ranks: int = 2) -> Buffer:
    """A Buffer object with nothing behind it: its fronts have no GPU, memory or kernels, and a plan cache that
    stops the call at its first look-up; a call that gets past its argument checks to a plan, a kernel or the
    memory fails otherwise (_Looked, or AttributeError)."""
    buf = object.__new__(Buffer)
    buf._closed = False
    res = SimpleNamespace(num_max_dispatch_tokens_per_rank=8, hidden=256, num_experts=64)
    normal = object.__new__(IntranodeFront)
    normal.res, normal.plans, normal.device, normal.buffer_id = res, _Plans(), 0, id(buf)
    normal.num_ranks, normal.num_nvl_ranks, normal.num_experts = num_ranks, num_ranks, 64
    normal.ops = SimpleNamespace(check_pending=lambda capturing: None)
    low_latency = object.__new__(LowLatencyFront)
    low_latency.res, low_latency.plans, low_latency.device, low_latency.buffer_id = res, _Plans(), 0, id(buf)
    low_latency.num_ranks, low_latency.ops = num_ranks, SimpleNamespace(raise_status=lambda: None)
    buf._normal, buf._low_latency = normal, low_latency
    return buf


IDX = np.zeros((4, 2), dtype=np.int64)


@pytest.mark.parametrize("name, minimum, value", [
    (name, minimum, value) for name, minimum in (("num_worst_tokens", 0), ("expert_alignment", 1), ("num_experts", 1))
    for value in ("8", 8.0, None, True, np.array(8.0)) if not (name == "num_experts" and value is None)  # the default
], ids=repr)
def test_dispatch_refuses_a_number_that_is_not_an_int_before_its_plan(name, minimum, value):
    """8.0 == 8 and True == 1 (and hash alike): in the plan key they would find the plan of 8 or 1 and skip every
    check; np.array(8.0) there would raise a bare TypeError (unhashable)."""
    with pytest.raises(ArgumentTypeError) as e:
        _hollow().dispatch(None, topk_idx=IDX, **{name: value})
    assert str(e.value) == f"{name} must be an int >= {minimum}, got {value!r}"


def test_dispatch_and_layout_key_their_plans_by_ints():
    with pytest.raises(_Looked) as e:
        _hollow().dispatch(None, topk_idx=IDX, num_experts=np.int64(64), num_worst_tokens=np.array(8),
                           expert_alignment=np.uint8(2))
    source, worst, alignment = e.value.key[4:7]
    assert source == ("auto", 64) and (worst, alignment) == (8, 2) and {type(worst), type(alignment)} == {int}
    assert type(source[1]) is int
    with pytest.raises(_Looked) as e:
        _hollow().get_dispatch_layout(IDX, np.int32(64))
    assert e.value.key[2] == 64 and type(e.value.key[2]) is int


@pytest.mark.parametrize("value", ["64", 64.0, None, True, np.array(64.0)], ids=repr)
def test_get_dispatch_layout_refuses_num_experts_that_is_not_an_int(value):
    with pytest.raises(ArgumentTypeError) as e:
        _hollow().get_dispatch_layout(IDX, value)
    assert str(e.value) == f"num_experts must be an int >= 1, got {value!r}"
    with pytest.raises(ArgumentError, match="num_experts=63 is not divisible by the 2 ranks"):
        _hollow().get_dispatch_layout(IDX, np.int64(63))


@pytest.mark.parametrize("name", ["num_max_dispatch_tokens_per_rank", "num_experts"])
@pytest.mark.parametrize("value", ["8", 8.0, None, False, np.array(8.0)], ids=repr)
def test_low_latency_dispatch_refuses_sizes_that_are_not_ints_before_its_plan(name, value):
    sizes = {"num_max_dispatch_tokens_per_rank": 8, "num_experts": 64, name: value}
    with pytest.raises(ArgumentTypeError) as e:
        _hollow().low_latency_dispatch(None, None, **sizes)
    assert str(e.value) == f"{name} must be an int >= 1, got {value!r}"


def test_low_latency_dispatch_keys_ints_and_refuses_flags_given_as_text():
    with pytest.raises(_Looked) as e:
        _hollow().low_latency_dispatch(None, None, np.int64(8), np.array(64))
    assert e.value.key[4:6] == (8, 64) and {type(v) for v in e.value.key[4:6]} == {int}
    buf = _hollow()
    buf._low_latency.plans = Plans()  # "False" is in the key as given: it finds no plan, and its checks refuse it
    for flag in ("use_fp8", "round_scale", "use_ue8m0"):
        with pytest.raises(ArgumentTypeError, match=rf"^{flag} must be True or False, got 'False'$"):
            buf.low_latency_dispatch(None, None, 8, 64, **{flag: "False"})


@pytest.mark.parametrize("call", ["dispatch", "combine"])
def test_wait_stats_are_checked_before_a_plan_is_kept(call):
    """DeepEP's dispatch_wait_recv_cost_stats / combine_wait_recv_cost_stats: int64 [ranks] on the GPU, refused by
    name before the call's plan is made (a plan kept under a wrong array's key would skip the checks next time)."""
    buf = _hollow()
    front = buf._low_latency
    front.plans = Plans()
    front.ops.check_handle = lambda handle, buffer_id: None
    handle = SimpleNamespace(num_topk=2, num_max_dispatch_tokens_per_rank=8, hidden=256, num_experts=64)
    name = f"{call}_wait_recv_cost_stats"
    for bad, match in ((np.zeros(2, np.int32), f"^{name} must be int64, got int32"),
                       (np.zeros(3, np.int64), rf"^{name} must have shape \[R=2\] with R the number of ranks, "
                                               r"got \[3\]"),
                       (np.zeros(2, np.int64), f"^{name} must be on a CUDA device")):
        with pytest.raises((ArgumentError, ArgumentTypeError), match=match):
            if call == "dispatch":
                buf.low_latency_dispatch(None, None, 8, 64, dispatch_wait_recv_cost_stats=bad)
            else:
                buf.low_latency_combine(None, None, None, handle, combine_wait_recv_cost_stats=bad)
        assert not front.plans  # refused before any plan was kept


def test_local_memory_names_this_ranks_own_regions_and_refuses_a_missing_one():
    buf = _hollow()
    buf.num_nvl_bytes = 1 << 20
    buf.mem = SimpleNamespace(nvl=object(), sym=None, nvl_payload_ptr=lambda: 0x7000)
    assert buf.local_memory() == (0x7000, 1 << 20)
    with pytest.raises(ArgumentError, match="this Buffer has no symmetric region"):
        buf.local_memory(symmetric=True)
    buf.mem = SimpleNamespace(nvl=None, sym=SimpleNamespace(base=0x9000, num_bytes=4096))
    assert buf.local_memory(symmetric=True) == (0x9000, 4096)
    with pytest.raises(ArgumentError, match="this Buffer has no NVLink buffer"):
        buf.local_memory()
    with pytest.raises(ArgumentTypeError, match="symmetric must be True or False, got 'yes'"):
        buf.local_memory(symmetric="yes")
    buf._closed = True
    with pytest.raises(EpjitError, match="closed"):
        buf.local_memory()


def test_clean_low_latency_buffer_refuses_sizes_that_are_not_ints():
    buf = _hollow()
    for name, value in (("hidden", 256.0), ("num_experts", "64"), ("num_max_dispatch_tokens_per_rank", True)):
        with pytest.raises(ArgumentTypeError, match=rf"^{name} must be an int >= 1, got {value!r}$"):
            buf.clean_low_latency_buffer(**{name: value})  # 256.0 == 256: it would have been taken
    cleaned = []
    res = buf._low_latency.res
    res.mem, res.streams = SimpleNamespace(synchronize=lambda stream: None), SimpleNamespace(comm=None)
    res.group = SimpleNamespace(barrier=lambda: None)
    buf._low_latency.ops = SimpleNamespace(clean=lambda: cleaned.append(True), shrink=None)
    buf.clean_low_latency_buffer(np.int64(8), np.array(256), 64)
    assert cleaned == [True]
    # Shrink mode cleans with the device barrier of the live ranks, never the host group's (a dead rank's hang).
    res.group = SimpleNamespace(barrier=lambda: pytest.fail("a host barrier in shrink mode"))
    buf._low_latency.ops = SimpleNamespace(clean_live=lambda: cleaned.append("live"), shrink=object())
    buf.clean_low_latency_buffer()
    assert cleaned == [True, "live"]
    with pytest.raises(ArgumentError, match=r"clean_low_latency_buffer\(8, 128, None\): this Buffer was made for"):
        buf.clean_low_latency_buffer(8, 128)


# --------------------------------------------------------------------------------------------------------------
# The launcher from Python
# --------------------------------------------------------------------------------------------------------------


def test_launch_refuses_a_rank_count_or_timeout_that_is_not_a_number(tmp_path):
    """Refused before any rank starts (the script would print if it ran)."""
    script = tmp_path / "ran.py"
    script.write_text("print('RAN')\n")
    for kwargs, error, message in (
        ({"n": "2"}, ArgumentTypeError, "n (the number of ranks) must be an int >= 1, got '2'"),
        ({"n": 2.0}, ArgumentTypeError, "n (the number of ranks) must be an int >= 1, got 2.0"),
        ({"n": 0}, ArgumentError, "n (the number of ranks) must be an int >= 1, got 0"),
        ({"n": 1, "timeout": "30"}, ArgumentTypeError, "timeout must be a number of seconds or None, got '30'"),
        ({"n": 1, "timeout": True}, ArgumentTypeError, "timeout must be a number of seconds or None, got True"),
        ({"n": 1, "timeout": 0}, ArgumentError, "timeout must be > 0 seconds, got 0"),
        ({"n": 1, "timeout": float("nan")}, ArgumentError, "timeout must be > 0 seconds, got nan"),
    ):
        n = kwargs.pop("n")
        with pytest.raises(error) as e:
            launch(n, [str(script)], **kwargs)
        assert str(e.value) == message


def test_a_config_that_is_not_a_config_is_refused_naming_it():
    from epjit.config import config_key

    assert config_key(None) == ()
    config = Config(24, 6, 256)
    assert config_key(config) is config
    with pytest.raises(ArgumentTypeError, match="config must be an epjit.Config, got dict"):
        config_key({"num_sms": 24})


@pytest.mark.parametrize("field", ["rdma_chunk_send", "rdma_chunk_recv", "nvl_chunk_send"])
def test_config_chunks_below_one_are_refused(field):
    with pytest.raises(ArgumentError, match=f"Config.{field}=0 must be >= 1"):
        dataclasses.replace(Config(24, 6, 256), **{field: 0})


def test_a_jitted_low_latency_site_refuses_what_the_eager_call_refuses():
    """epjit.jax's call sites take their sizes at trace time and are checked by the eager dispatch's own rules:
    tokens past the Buffer's maximum, top-k outside 1..LOW_LATENCY_MAX_TOPK, round_scale or use_ue8m0 without
    use_fp8, each by the same message, before any site is made."""
    front = _hollow()._low_latency
    for sizes, match in (({"num_tokens": 9, "num_topk": 2}, r"^x has 9 tokens but num_max_dispatch_tokens_per_rank=8"),
                         ({"num_tokens": 4, "num_topk": 0}, r"^topk_idx has 0 columns; 1 to \d+ are supported"),
                         ({"num_tokens": 4, "num_topk": 2, "use_ue8m0": True},
                          r"^round_scale and use_ue8m0 need use_fp8=True")):
        with pytest.raises(ArgumentError, match=match):
            front.xla_site("dispatch", **sizes)
