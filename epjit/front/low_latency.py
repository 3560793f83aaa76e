"""The low-latency front: the checks and plan cache of low_latency_dispatch and low_latency_combine over
epjit.ops.low_latency, and the sizes a low-latency Buffer is made with."""

from __future__ import annotations

from typing import Any

from ..arrays import address, check, fingerprint, from_cupy, kernel_array
from ..errors import ArgumentError, check_flag, check_int, with_rank
from ..group import Group
from ..kernels.low_latency import (
    LOGFMT_CHANNELS,
    LOW_LATENCY_MAX_TOPK,
    MAX_DYNAMIC_SHARED_BYTES,
    dispatch_shared_bytes,
    low_latency_size_hint,
)
from ..ops.low_latency import (
    CombineInputs,
    DispatchInputs,
    LowLatency,
    LowLatencyCombineResult,
    LowLatencyDispatchResult,
    LowLatencyHandle,
)
from ..ops.xla import LowLatencyCombineSite, LowLatencyDispatchSite
from .common import Plans, Resources, check_rank_to_mask


def low_latency_rdma_bytes(group: Group, m: int, h: int, e: int, num_rdma_bytes: int) -> int:
    """Validate a low-latency Buffer's sizes (num_max_dispatch_tokens_per_rank, hidden, num_experts: the same on
    every rank); returns the heap bytes to reserve."""
    r = group.size
    group.check_same("Buffer(num_max_dispatch_tokens_per_rank, hidden, num_experts)", (m, h, e))
    if m <= 0 or h <= 0 or e <= 0:
        raise ArgumentError(with_rank(
            "low_latency_mode=True needs num_max_dispatch_tokens_per_rank, hidden and num_experts (> 0), got "
            f"{m}, {h}, {e}"))
    if e % r:
        raise ArgumentError(with_rank(f"num_experts={e} is not divisible by the {r} ranks (each rank owns "
                                      "num_experts / ranks experts)"))
    if h % 8:
        raise ArgumentError(with_rank(f"hidden={h} must be a multiple of 8 (16-byte rows)"))
    shared = dispatch_shared_bytes(h, m, LOW_LATENCY_MAX_TOPK, e, r)
    if shared > MAX_DYNAMIC_SHARED_BYTES:
        raise ArgumentError(with_rank(
            f"num_max_dispatch_tokens_per_rank={m} with hidden={h} is too large for low-latency mode: each "
            f"dispatch block stages two tokens, every topk_idx entry and two ints an expert in shared memory "
            f"({shared} bytes at top-{LOW_LATENCY_MAX_TOPK}, {MAX_DYNAMIC_SHARED_BYTES} available)"))
    need = low_latency_size_hint(m, h, r, e)
    if num_rdma_bytes and num_rdma_bytes < need:
        raise ArgumentError(with_rank(
            f"num_rdma_bytes={num_rdma_bytes} is below the {need} bytes low-latency mode needs for "
            f"{m} tokens x hidden {h} x {e} experts on {r} ranks: use Buffer.get_low_latency_size_hint(...)"))
    return num_rdma_bytes or need


def _check_num_topk(num_topk: int) -> None:
    """A low-latency dispatch takes 1 to LOW_LATENCY_MAX_TOPK experts a token (eager and jitted alike)."""
    if not 1 <= num_topk <= LOW_LATENCY_MAX_TOPK:
        raise ArgumentError(with_rank(f"topk_idx has {num_topk} columns; 1 to {LOW_LATENCY_MAX_TOPK} are "
                                      "supported in low-latency mode"))


def _fp8_options(use_fp8: bool, round_scale: bool, use_ue8m0: bool, hidden: int) -> bool:
    """A dispatch's FP8 options checked against each other and the hidden size: round_scale as the kernels take it
    (use_ue8m0 implies it)."""
    round_scale = round_scale or use_ue8m0
    if not use_fp8 and round_scale:
        raise ArgumentError(with_rank("round_scale and use_ue8m0 need use_fp8=True"))
    if use_fp8 and hidden % 128:
        raise ArgumentError(with_rank(f"use_fp8=True needs hidden % 128 == 0, hidden={hidden}"))
    return round_scale


def _flags(return_recv_hook: Any, async_finish: Any) -> tuple[bool, bool]:
    """A call's two flags as bools (refused as check_flag refuses them), the common case read without a call."""
    if type(return_recv_hook) is not bool or type(async_finish) is not bool:
        return check_flag(return_recv_hook, "return_recv_hook"), check_flag(async_finish, "async_finish")
    return return_recv_hook, async_finish


class LowLatencyFront:
    """Low-latency mode of a Buffer: argument checks, plans, and the family's ops."""

    def __init__(self, res: Resources) -> None:
        self.res, self.device, self.buffer_id, self.num_ranks = res, res.device, res.buffer_id, res.group.size
        self.plans = Plans()
        self.dispatch_inputs, self.combine_inputs = DispatchInputs(), CombineInputs()  # refilled by each call
        env = res.settings
        shrink_timeout = (env.shrink_timeout_s or env.timeout_s) if res.enable_shrink else None
        self.ops = LowLatency(res.mem, res.streams, res.outputs, res.profile, self.device,
                              res.num_max_dispatch_tokens_per_rank, res.hidden, res.num_experts,
                              env.ll_force_puts, env.ll_num_sms, shrink_timeout)

    def close(self) -> None:
        self.ops.close()

    def check(self) -> None:
        """Raise, once, what earlier kernels found."""
        self.ops.raise_status()

    # ------------------------------------------------------------------------------------------------ dispatch

    def dispatch(self, x: Any, topk_idx: Any, num_max_dispatch_tokens_per_rank: Any, num_experts: Any,
                 use_fp8: Any, round_scale: Any, use_ue8m0: Any, return_recv_hook: Any, async_finish: Any,
                 stats: Any, wait_stats: Any = None) -> LowLatencyDispatchResult:
        ops = self.ops
        ops.raise_status()
        if type(num_max_dispatch_tokens_per_rank) is not int or type(num_experts) is not int:  # as in dispatch
            num_max_dispatch_tokens_per_rank = check_int(num_max_dispatch_tokens_per_rank,
                                                         "num_max_dispatch_tokens_per_rank", 1)
            num_experts = check_int(num_experts, "num_experts", 1)
        key = ("ll_dispatch", fingerprint(x), fingerprint(topk_idx), fingerprint(stats),
               num_max_dispatch_tokens_per_rank, num_experts, use_fp8, round_scale, use_ue8m0, fingerprint(wait_stats))
        plan = self.plans.get(key)
        if plan is None:  # (every array checked before the plan is kept under the key)
            wait_stats = self._wait_stats(wait_stats, "dispatch_wait_recv_cost_stats")
            plan, x, topk_idx, stats = self._dispatch_plan(key, x, topk_idx, stats, num_max_dispatch_tokens_per_rank,
                                                           num_experts, use_fp8, round_scale, use_ue8m0)
        inputs = self.dispatch_inputs
        inputs.x, inputs.topk_idx, inputs.cumulative_stats, inputs.wait_stats = x, topk_idx, stats, wait_stats
        hook, async_finish = _flags(return_recv_hook, async_finish)
        return ops.dispatch(plan, inputs, self.buffer_id, hook, async_finish)

    def _dispatch_plan(self, key: tuple[Any, ...], x: Any, topk_idx: Any, stats: Any, num_max: int,
                       num_experts: int, use_fp8: Any, round_scale: Any, use_ue8m0: Any) -> tuple[Any, ...]:
        """Validate a dispatch whose shape has no plan yet: its plan, and this call's arrays as the kernels take
        them."""
        dev, res = self.device, self.res
        # The flags are in the key as given: "False" (truthy) never finds a plan, and is refused here.
        use_fp8, round_scale, use_ue8m0 = (check_flag(v, n) for v, n in (
            (use_fp8, "use_fp8"), (round_scale, "round_scale"), (use_ue8m0, "use_ue8m0")))
        m, hidden, e, r = res.num_max_dispatch_tokens_per_rank, res.hidden, res.num_experts, self.num_ranks
        if num_max != m or num_experts != e:
            raise ArgumentError(with_rank(f"num_max_dispatch_tokens_per_rank={num_max}, num_experts={num_experts}: "
                                          f"this Buffer was made for {m} and {e}"))
        x_info = check(x, "x", dtype="bfloat16", shape=("N", ("H", hidden)), shape_note="with H the Buffer's hidden",
                       device=dev)
        num_tokens = x_info.shape[0]
        if num_tokens > m:
            raise ArgumentError(with_rank(f"x has {num_tokens} tokens but num_max_dispatch_tokens_per_rank={m}"))
        k_info = check(topk_idx, "topk_idx", dtype="int64", shape=(("N", num_tokens), "K"),
                       shape_note="with N matching x", device=dev)
        num_topk = k_info.shape[1]
        _check_num_topk(num_topk)
        round_scale = _fp8_options(use_fp8, round_scale, use_ue8m0, hidden)
        if stats is not None:
            name = "cumulative_local_expert_recv_stats"
            stats = kernel_array(stats, check(stats, name, dtype="int32", shape=(e // r,), device=dev), name)
        plan = self.ops.dispatch_plan(x_info.framework, num_tokens, num_topk, use_fp8, round_scale, use_ue8m0)
        return (self.plans.remember(key, plan), kernel_array(x, x_info, "x"),
                kernel_array(topk_idx, k_info, "topk_idx"), stats)

    def _wait_stats(self, wait_stats: Any, name: str) -> Any:
        """DeepEP's dispatch_wait_recv_cost_stats / combine_wait_recv_cost_stats, checked: int64 [ranks] (or None)."""
        if wait_stats is None:
            return None
        info = check(wait_stats, name, dtype="int64", shape=(("R", self.num_ranks),),
                     shape_note="with R the number of ranks", device=self.device)
        return kernel_array(wait_stats, info, name)

    # ------------------------------------------------------------------------------------------------ combine

    def next_combine_buffer(self, handle: LowLatencyHandle) -> Any:
        ops = self.ops
        ops.raise_status()
        ops.check_handle(handle, self.buffer_id)
        return from_cupy(ops.next_combine_buffer(handle), handle.meta.framework)

    def combine(self, y: Any, topk_idx: Any, topk_weights: Any, handle: LowLatencyHandle, zero_copy: Any,
                out: Any, return_recv_hook: Any, async_finish: Any, use_logfmt: Any,
                wait_stats: Any = None) -> LowLatencyCombineResult:
        ops = self.ops
        ops.raise_status()
        ops.check_handle(handle, self.buffer_id)
        # use_logfmt is in the key as given: "False" (truthy) never finds a plan, and is refused there.
        key = ("ll_combine", fingerprint(y), fingerprint(topk_idx), fingerprint(topk_weights), fingerprint(out),
               handle.num_topk, handle.num_max_dispatch_tokens_per_rank, handle.hidden, handle.num_experts,
               use_logfmt, fingerprint(wait_stats))
        plan = self.plans.get(key)
        if plan is None:  # (every array checked before the plan is kept under the key)
            wait_stats = self._wait_stats(wait_stats, "combine_wait_recv_cost_stats")
            plan, y, topk_idx, topk_weights, out = self._combine_plan(key, y, topk_idx, topk_weights, out, handle,
                                                                      use_logfmt)
        if check_flag(zero_copy, "zero_copy"):
            if use_logfmt:
                raise ArgumentError(with_rank("zero_copy=True and use_logfmt=True together are not supported "
                                              "(as in DeepEP): a LogFMT combine encodes y on the way out"))
            if not ops.is_combine_buffer(address(y)):
                raise ArgumentError(with_rank(
                    "zero_copy=True needs y from get_next_low_latency_combine_buffer(handle)"))
        inputs = self.combine_inputs
        inputs.y, inputs.topk_idx, inputs.topk_weights, inputs.out = y, topk_idx, topk_weights, out
        inputs.wait_stats = wait_stats
        hook, async_finish = _flags(return_recv_hook, async_finish)
        return ops.combine(plan, inputs, handle, hook, async_finish)

    def _combine_plan(self, key: tuple[Any, ...], y: Any, topk_idx: Any, topk_weights: Any, out: Any,
                      handle: LowLatencyHandle, use_logfmt: Any) -> tuple[Any, ...]:
        """Validate a combine whose shape has no plan yet: its plan, and this call's arrays as the kernels take
        them."""
        dev = self.device
        m, hidden, e, r = handle.num_max_dispatch_tokens_per_rank, handle.hidden, handle.num_experts, self.num_ranks
        if check_flag(use_logfmt, "use_logfmt"):
            if hidden % LOGFMT_CHANNELS:
                raise ArgumentError(with_rank(f"use_logfmt=True needs hidden % {LOGFMT_CHANNELS} == 0 (a LogFMT "
                                              f"group is {LOGFMT_CHANNELS} channels), hidden={hidden}"))
            if self.ops.puts:
                raise ArgumentError(with_rank(
                    "use_logfmt=True needs every peer reached through an NVLink pointer: this Buffer sends to some "
                    "through the put path (a peer on another node, or EPJIT_LL_FORCE_PUTS), which has no LogFMT "
                    "encoder"))
        y_info = check(y, "y", dtype="bfloat16", shape=(e // r, r * m, hidden), shape_note="as the dispatch delivered",
                       device=dev)
        k_info = check(topk_idx, "topk_idx", dtype="int64", shape=("N", ("K", handle.num_topk)),
                       shape_note="as dispatched", device=dev)
        num_tokens = k_info.shape[0]
        if num_tokens > m:
            raise ArgumentError(with_rank(f"topk_idx has {num_tokens} tokens but num_max_dispatch_tokens_per_rank={m}"))
        w_info = check(topk_weights, "topk_weights", dtype="float32", shape=(("N", num_tokens), ("K", handle.num_topk)),
                       shape_note="matching topk_idx", device=dev)
        if out is not None:
            out = kernel_array(out, check(out, "out", dtype="bfloat16", shape=(("N", num_tokens), ("H", hidden)),
                                          device=dev), "out")
        plan = self.ops.combine_plan(y_info.framework, num_tokens, handle.num_topk, use_logfmt)
        return (self.plans.remember(key, plan), kernel_array(y, y_info, "y"),
                kernel_array(topk_idx, k_info, "topk_idx"), kernel_array(topk_weights, w_info, "topk_weights"), out)

    # ------------------------------------------------------------------------------------------------ jax.jit

    def xla_site(self, call: str, num_tokens: int, num_topk: int, use_fp8: bool = False, round_scale: bool = False,
                 use_ue8m0: bool = False) -> Any:
        """A call site inside an XLA program (epjit.ops.xla), its static sizes checked as the eager call checks
        them: ``call`` "dispatch" or "combine"."""
        res = self.res
        m, hidden = res.num_max_dispatch_tokens_per_rank, res.hidden
        if num_tokens > m:
            raise ArgumentError(with_rank(f"x has {num_tokens} tokens but num_max_dispatch_tokens_per_rank={m}"))
        _check_num_topk(num_topk)
        if call == "combine":
            return LowLatencyCombineSite(self.ops, num_tokens, num_topk)
        round_scale = _fp8_options(use_fp8, round_scale, use_ue8m0, hidden)
        return LowLatencyDispatchSite(self.ops, num_tokens, num_topk, use_fp8, round_scale, use_ue8m0)

    # ------------------------------------------------------------------------------------------------ reset

    def clean(self, num_max_dispatch_tokens_per_rank: Any, hidden: Any, num_experts: Any) -> None:
        """Collective: forget every low-latency call; the sizes, if given, must be the Buffer's."""
        res = self.res
        given = tuple(value if value is None else check_int(value, name, 1) for name, value in (
            ("num_max_dispatch_tokens_per_rank", num_max_dispatch_tokens_per_rank), ("hidden", hidden),
            ("num_experts", num_experts)))
        mine = (res.num_max_dispatch_tokens_per_rank, res.hidden, res.num_experts)
        if any(g is not None and g != m for g, m in zip(given, mine, strict=True)):
            raise ArgumentError(with_rank(f"clean_low_latency_buffer{given}: this Buffer was made for {mine} "
                                          "(num_max_dispatch_tokens_per_rank, hidden, num_experts)"))
        res.mem.synchronize(res.streams.comm)
        if self.ops.shrink is not None:  # no host collective: a dead rank would hang it (ops.clean_live)
            self.ops.clean_live()
            return
        res.group.barrier()
        self.ops.clean()
        res.group.barrier()

    # ------------------------------------------------------------------------------------------------ shrink

    def _shrink_call(self, call: str) -> None:
        if self.ops.shrink is None:
            raise ArgumentError(with_rank(f"{call} needs a Buffer made with enable_shrink=True (and "
                                          "low_latency_mode=True)"))

    def update_mask(self, rank_to_mask: Any, mask: Any) -> None:
        self._shrink_call("low_latency_update_mask_buffer")
        self.ops.shrink.update(check_rank_to_mask(rank_to_mask, self.num_ranks), check_flag(mask, "mask"))

    def query_mask(self, mask_status: Any) -> None:
        self._shrink_call("low_latency_query_mask_buffer")
        info = check(mask_status, "mask_status", dtype="int32", shape=(self.num_ranks,), device=self.device)
        self.ops.shrink.query(address(kernel_array(mask_status, info, "mask_status")), info.framework)

    def clean_mask(self) -> None:
        self._shrink_call("low_latency_clean_mask_buffer")
        self.ops.shrink.clean()

    def mask_reports(self) -> list[dict[str, Any]]:
        self._shrink_call("low_latency_mask_reports")
        return self.ops.shrink.mask_reports()
