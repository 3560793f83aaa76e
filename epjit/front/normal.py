"""The normal-mode fronts: the checks and plan cache of get_dispatch_layout, dispatch and combine, inside one NVLink
node (IntranodeFront over epjit.ops.intranode) and across nodes (InternodeFront over epjit.ops.internode, which
redoes what differs: the kernels' spec, the buffer need, the layout's counts per node).

Every rank computes the same sizes and needs from the same (checked-in-notify) arguments, so a refusal here is
raised on every rank when the arguments agree; when they do not, notify reports the mismatch on every rank.
"""

from __future__ import annotations

import dataclasses
import sys
from typing import Any

from ..arrays import address, check, fingerprint, kernel_array
from ..config import Config, check_internode_need, config_key, expert_cap, get_combine_config, get_dispatch_config
from ..errors import ArgumentError, ArgumentTypeError, check_flag, check_int, with_rank
from ..kernels.internode import internode_combine_fp8_spec
from ..kernels.intranode import combine_fp8_spec
from ..ops.internode import Internode
from ..ops.intranode import Intranode
from ..ops.layout import DispatchLayout, Layout
from ..ops.normal import (
    CombineInputs,
    CombineResult,
    DispatchHandle,
    DispatchInputs,
    DispatchResult,
    DispatchShape,
    LayoutInputs,
)
from ..ops.notify import host_record_bytes
from ..ops.shrink import NormalShrinkMask
from ..ops.streams import Event, caller_stream, is_capturing
from ..ops.xla import HandleParts, HandleSizes, NormalCombineSite, NormalDispatchSite, layout_plan
from .common import Plans, Resources, check_rank_to_mask


class IntranodeFront:
    """Normal mode of a Buffer inside one NVLink node: argument checks, plans, and the family's ops."""

    def __init__(self, res: Resources, shrink: bool = False) -> None:
        """``shrink``: shrink mode (enable_shrink on a normal-mode Buffer, docs/reliability.md)."""
        group = res.group
        self.shrink = shrink
        self.res, self.device, self.buffer_id = res, res.device, res.buffer_id
        self.num_ranks, self.num_nvl_ranks, self.num_experts = group.size, group.num_nvl_ranks, res.num_experts
        self.plans = Plans()
        self.dispatch_inputs, self.combine_inputs = DispatchInputs(), CombineInputs()  # refilled by each call
        self.ops = self._ops(res)
        self.layout_ops = Layout(res.streams, res.outputs, self.device, group.size, group.num_nvl_ranks)
        # what a call without a config gets (a test may set its own)
        self.dispatch_config = get_dispatch_config(self.num_ranks, num_nvl_ranks=self.num_nvl_ranks)
        self.combine_config = get_combine_config(self.num_ranks, num_nvl_ranks=self.num_nvl_ranks)

    def _ops(self, res: Resources) -> Intranode:
        env = res.settings
        timeout = (env.shrink_timeout_s or env.timeout_s) if self.shrink else None
        return Intranode(res.mem, res.streams, res.outputs, res.profile, self.device, res.num_experts, timeout)

    def close(self) -> None:
        self.ops.close()

    def check(self) -> None:
        """Raise what a refused worst-token dispatch or a replayed graph's notify found that no call raised yet."""
        self.ops.check_pending(self._caller_capturing)

    def _caller_capturing(self) -> bool:
        """Whether a caller's stream (torch's current one, if torch is in use, or CuPy's) is capturing a graph."""
        streams = {caller_stream("cupy", self.device)}
        if "torch" in sys.modules:
            streams.add(caller_stream("torch", self.device))
        return any(is_capturing(s) for s in streams)

    def _check_num_experts(self, num_experts: Any) -> int:
        num_experts = check_int(num_experts, "num_experts", 1)
        if num_experts % self.num_ranks:
            raise ArgumentError(with_rank(f"num_experts={num_experts} is not divisible by the {self.num_ranks} "
                                          "ranks (each rank owns num_experts / ranks experts)"))
        return num_experts

    # ------------------------------------------------------------------------------------------------ layout

    def get_dispatch_layout(self, topk_idx: Any, num_experts: Any, previous_event: Event | None,
                            async_finish: Any) -> DispatchLayout:
        if type(num_experts) is not int:  # no 64.0 or True in a key: it would find the plan of 64 or 1
            num_experts = self._check_num_experts(num_experts)
        key = ("layout", fingerprint(topk_idx), num_experts, previous_event is None)
        plan = self.plans.get(key)
        if plan is None:
            info = check(topk_idx, "topk_idx", dtype="int64", ndim=2, device=self.device)
            num_experts = self._check_num_experts(num_experts)
            kind = "torch" if info.framework == "torch" and previous_event is None else "cupy"
            plan = self.plans.remember(key, self.layout_ops.plan(info.framework, kind, *info.shape, num_experts))
            topk_idx = kernel_array(topk_idx, info, "topk_idx")
        return self.layout_ops.run(plan, topk_idx, previous_event, check_flag(async_finish, "async_finish"))

    def _layout_inputs(self, layout: DispatchLayout, num_tokens: int) -> tuple[LayoutInputs, int]:
        """A layout's kernel arguments and its number of experts: taken as made if get_dispatch_layout made it for
        this many tokens, validated otherwise."""
        if not isinstance(layout, DispatchLayout):
            raise ArgumentTypeError(with_rank(f"layout must be a DispatchLayout, got {type(layout).__name__}"))
        made = layout.made
        if made is not None and made.num_tokens == num_tokens:
            return LayoutInputs(made.per_rank_ptr, made.per_expert_ptr, made.in_rank_ptr, made, made.invalid_ptr,
                                (made.owner,), made.per_node_ptr), made.num_experts
        r = self.num_ranks
        per_rank = self._hand_made(layout.num_tokens_per_rank, "num_tokens_per_rank", dtype="int32", shape=(r,))
        per_expert = self._hand_made(layout.num_tokens_per_expert, "num_tokens_per_expert", dtype="int32", ndim=1)
        in_rank = self._hand_made(layout.is_token_in_rank, "is_token_in_rank", dtype="bool",
                                  shape=(("N", num_tokens), r), shape_note="with N matching x")
        per_node = self._per_node(layout)  # what keeps is_token_in_rank alive: the array itself (or its view)
        return (LayoutInputs(address(per_rank), address(per_expert), address(in_rank), in_rank, 0,
                             (per_rank, per_expert, in_rank, per_node), address(per_node)),
                self._check_num_experts(per_expert.shape[0]))

    def _hand_made(self, array: Any, name: str, **spec: Any) -> Any:
        """One array of a layout built by hand, checked, as the kernels take it."""
        name = f"layout.{name}"
        return kernel_array(array, check(array, name, device=self.device, **spec), name)

    def _per_node(self, layout: DispatchLayout) -> Any:
        """A hand-made layout's counts per node, which notify's RDMA leg sends (None inside one node)."""
        return None

    # ------------------------------------------------------------------------------------------------ dispatch

    def dispatch(self, x: Any, topk_idx: Any, topk_weights: Any, layout: DispatchLayout | None,
                 handle: DispatchHandle | None, num_worst_tokens: Any, expert_alignment: Any, config: Config | None,
                 previous_event: Event | None, async_finish: Any, num_experts: Any) -> DispatchResult:
        ops = self.ops
        ops.check_pending(self._caller_capturing)
        if type(async_finish) is not bool:  # before the layout kernel a call may run
            async_finish = check_flag(async_finish, "async_finish")
        # Numbers enter the plan key as ints: 8.0 or True would find the plan of 8 or 1 and skip every check.
        if type(num_worst_tokens) is not int or type(expert_alignment) is not int:
            num_worst_tokens = check_int(num_worst_tokens, "num_worst_tokens")
            expert_alignment = check_int(expert_alignment, "expert_alignment", 1)
        if num_experts is not None and type(num_experts) is not int:
            num_experts = check_int(num_experts, "num_experts", 1)
        auto_experts = 0  # dispatch computes the layout itself (from topk_idx)
        if handle is not None:
            if not isinstance(handle, DispatchHandle) or handle.buffer_id != self.buffer_id:
                raise ArgumentError(with_rank("handle must come from a dispatch of this Buffer"))
            if self.shrink:
                raise ArgumentError(with_rank("dispatch(handle=...) replays a handle's counts, which a rank masked "
                                              "since would make wrong: a Buffer made with enable_shrink=True "
                                              "dispatches from a layout (or topk_idx) every time"))
            source: Any = (handle.num_tokens, handle.hidden, handle.num_topk, handle.num_channels, handle.num_experts)
        elif layout is not None:
            made = layout.made if isinstance(layout, DispatchLayout) else None
            source = None if made is None else ("layout", made.num_tokens, made.num_experts)
        elif topk_idx is not None:
            auto_experts = num_experts if num_experts is not None else self.num_experts
            if not auto_experts:
                raise ArgumentError(with_rank("dispatch without a layout needs num_experts (here or on the Buffer) "
                                              "to compute one"))
            source = ("auto", auto_experts)
        else:
            raise ArgumentError(with_rank("dispatch needs layout=get_dispatch_layout(...), or topk_idx, or a handle"))
        key = ("dispatch", fingerprint(x), fingerprint(topk_idx), fingerprint(topk_weights), source,
               num_worst_tokens, expert_alignment, config_key(config), previous_event is None)
        plan = self.plans.get(key)
        if plan is None:
            plan, x, topk_idx, topk_weights, layout_inputs = self._dispatch_plan(
                key, x, topk_idx, topk_weights, handle, layout, auto_experts, num_worst_tokens, expert_alignment,
                config, previous_event)
        else:
            if auto_experts:
                layout = self.get_dispatch_layout(topk_idx, auto_experts, None, False)
            layout_inputs = None if handle is not None else self._layout_inputs(layout, plan.num_tokens)[0]
        inputs = self.dispatch_inputs
        if plan.fp8:
            inputs.x, inputs.x_scales, inputs.topk_idx, inputs.topk_weights = x[0], x[1], topk_idx, topk_weights
        else:
            inputs.x, inputs.x_scales, inputs.topk_idx, inputs.topk_weights = x, None, topk_idx, topk_weights
        return ops.dispatch(plan, inputs, layout_inputs, handle, self.buffer_id, previous_event, async_finish)

    def _dispatch_x(self, x: Any) -> tuple[Any, Any, tuple[int, int], str]:
        """x as the kernels take it (a pair (x, scales) if FP8, else the array), its size, framework and dtype."""
        dev = self.device
        if isinstance(x, (tuple, list)):
            if len(x) != 2:
                raise ArgumentError(with_rank(f"x must be an array or a pair (x_fp8, scales), got {len(x)} items"))
            x_info = check(x[0], "x", dtype="float8_e4m3fn", ndim=2, device=dev)
            num_tokens, hidden = x_info.shape
            if hidden % 128:
                raise ArgumentError(with_rank(f"FP8 x has hidden={hidden}, which is not a multiple of 128"))
            s_info = check(x[1], "x_scales", dtype="float32", shape=(("N", num_tokens), hidden // 128),
                           shape_note="with N matching x and one scale per 128 channels", device=dev)
            return ((kernel_array(x[0], x_info, "x"), kernel_array(x[1], s_info, "x_scales")), True,
                    (num_tokens, hidden), x_info.framework)
        x_info = check(x, "x", dtype="bfloat16", ndim=2, device=dev)
        return kernel_array(x, x_info, "x"), False, x_info.shape, x_info.framework

    def _dispatch_topk(self, topk_idx: Any, topk_weights: Any, num_tokens: int) -> tuple[int, Any, Any]:
        """top-k, and topk_idx and topk_weights as the kernels take them (None: not given)."""
        dev = self.device
        num_topk = 0
        if topk_idx is not None:
            k_info = check(topk_idx, "topk_idx", dtype="int64", shape=(("N", num_tokens), "K"),
                           shape_note="with N matching x", device=dev)
            num_topk = k_info.shape[1]
            if not 1 <= num_topk <= 32:
                raise ArgumentError(with_rank(f"topk_idx has {num_topk} columns; 1 to 32 are supported"))
            topk_idx = kernel_array(topk_idx, k_info, "topk_idx")
        if topk_weights is not None:
            if topk_idx is None:
                raise ArgumentError(with_rank("topk_weights given without topk_idx"))
            w_info = check(topk_weights, "topk_weights", dtype="float32", shape=(("N", num_tokens), ("K", num_topk)),
                           shape_note="matching topk_idx", device=dev)
            topk_weights = kernel_array(topk_weights, w_info, "topk_weights")
        return num_topk, topk_idx, topk_weights

    def _dispatch_plan(self, key: tuple[Any, ...], x: Any, topk_idx: Any, topk_weights: Any,
                       handle: DispatchHandle | None, layout: Any, auto_experts: int, num_worst_tokens: Any,
                       expert_alignment: Any, config: Config | None, previous_event: Event | None) -> tuple[Any, ...]:
        """Validate a dispatch whose shape has no plan yet (a layout built by hand has none: it is checked here every
        call); its plan, this call's arrays as the kernels take them, and its layout's inputs (None with a handle;
        computed here, once everything else is checked, when the call gave topk_idx and no layout)."""
        x, fp8, (num_tokens, hidden), framework = self._dispatch_x(x)
        if hidden % 8 or hidden <= 0:
            raise ArgumentError(with_rank(f"hidden={hidden} must be a positive multiple of 8 (16-byte rows)"))
        num_topk, topk_idx, topk_weights = self._dispatch_topk(topk_idx, topk_weights, num_tokens)
        num_worst_tokens = check_int(num_worst_tokens, "num_worst_tokens")
        expert_alignment = check_int(expert_alignment, "expert_alignment", 1)
        layout_inputs = None
        if handle is not None:
            if handle.num_tokens != num_tokens or handle.hidden != hidden:
                raise ArgumentError(with_rank(f"x is [{num_tokens}, {hidden}] but the handle was made for "
                                              f"[{handle.num_tokens}, {handle.hidden}]"))
            if topk_idx is not None and num_topk != handle.num_topk:
                raise ArgumentError(with_rank(f"topk_idx has {num_topk} columns, the handle {handle.num_topk}"))
            num_experts = handle.num_experts
            config = self._resolve_config(config, self.dispatch_config, handle.num_channels, "the handle")
        else:
            config = self._resolve_config(config, self.dispatch_config, None, "")
            if auto_experts:
                self._check_need(config, hidden, num_topk, self._check_num_experts(auto_experts), fp8, "dispatch")
                layout = self.get_dispatch_layout(topk_idx, auto_experts, None, False)
            layout_inputs, num_experts = self._layout_inputs(layout, num_tokens)
        self._check_need(config, hidden, num_topk, num_experts, fp8, "dispatch")
        kind = "torch" if framework == "torch" and previous_event is None else "cupy"
        shape = DispatchShape(framework, kind, num_tokens, hidden, num_topk, fp8, topk_weights is not None,
                              topk_idx is not None, num_experts, num_worst_tokens, expert_alignment,
                              handle is not None)
        plan = self.plans.remember(key, self.ops.dispatch_plan(shape, self._spec_of(config), config))
        return plan, x, topk_idx, topk_weights, layout_inputs

    def _resolve_config(self, config: Config | None, base: Config, num_channels: int | None, what: str) -> Config:
        """The config a call runs with: the given one or ``base``, on a replayed handle's channels."""
        if config is not None and not isinstance(config, Config):
            raise ArgumentTypeError(with_rank(f"config must be an epjit.Config, got {type(config).__name__}"))
        if config is not None and num_channels is not None and config.num_channels != num_channels:
            raise ArgumentError(with_rank(f"config.num_sms={config.num_sms} but {what} was made with "
                                          f"{num_channels} SMs"))
        config = config or base
        if num_channels is not None and num_channels != config.num_channels:
            config = dataclasses.replace(config, num_sms=num_channels)
        return config

    def _spec_of(self, config: Config) -> Any:
        """The kernels' spec (their warp roles) a config runs."""
        try:
            return config.spec(self.num_ranks)
        except ValueError as e:
            raise ArgumentError(with_rank(f"config's warp roles cannot run on {self.num_ranks} ranks: {e}")) from None

    def _check_need(self, config: Config, hidden: int, num_topk: int, num_experts: int, fp8: bool,
                    what: str) -> None:
        """Refuse a call whose rings do not fit the Buffer's NVLink buffer."""
        need = config.nvl_bytes(self.num_ranks, hidden, num_topk, num_experts, fp8)
        if need > self.res.num_nvl_bytes:
            raise ArgumentError(with_rank(
                f"this {what} needs {need} bytes of NVLink buffer (hidden={hidden}, top-{num_topk}, {num_experts} "
                f"experts, {config}) but the Buffer has {self.res.num_nvl_bytes}: use "
                "Buffer.get_normal_size_hint(...)"))

    # ------------------------------------------------------------------------------------------------ combine

    def combine(self, y: Any, handle: DispatchHandle, topk_weights: Any, bias: Any, config: Config | None,
                previous_event: Event | None, async_finish: Any, use_fp8: Any = False) -> CombineResult:
        ops = self.ops
        ops.check_pending(self._caller_capturing)
        if not isinstance(handle, DispatchHandle) or handle.buffer_id != self.buffer_id:
            raise ArgumentError(with_rank("handle must be the .handle of a dispatch of this Buffer"))
        key = ("combine", fingerprint(y), fingerprint(topk_weights), fingerprint(bias), handle.num_rows,
               handle.num_tokens, handle.hidden, handle.num_topk, handle.num_channels, config_key(config),
               previous_event is None)
        if use_fp8 is not False:  # (a bf16 call's key and plan are the ones it always had)
            use_fp8 = check_flag(use_fp8, "use_fp8")
            key = (*key, "fp8") if use_fp8 else key
        plan = self.plans.get(key)
        if plan is None:
            plan, y, topk_weights, bias = self._combine_plan(key, y, handle, topk_weights, bias, config,
                                                             previous_event, use_fp8)
        inputs = self.combine_inputs
        inputs.y, inputs.topk_weights = y, topk_weights
        if bias is None:
            inputs.bias0 = inputs.bias1 = None
        elif type(bias) is tuple or type(bias) is list:
            inputs.bias0, inputs.bias1 = bias[0] if bias else None, bias[1] if len(bias) > 1 else None
        else:
            inputs.bias0, inputs.bias1 = bias, None
        if type(async_finish) is not bool:
            async_finish = check_flag(async_finish, "async_finish")
        return ops.combine(plan, inputs, handle, previous_event, async_finish)

    def _combine_plan(self, key: tuple[Any, ...], y: Any, handle: DispatchHandle, topk_weights: Any, bias: Any,
                      config: Config | None, previous_event: Event | None, fp8: bool) -> tuple[Any, ...]:
        """Validate a combine whose shape has no plan yet: its plan, and this call's arrays as the kernels take them
        (bias as given: None, an array, or a tuple of up to two)."""
        dev = self.device
        if fp8:
            self._check_combine_fp8(handle.hidden)
        y_info = check(y, "y", dtype="bfloat16", shape=(("rows", handle.num_rows), ("H", handle.hidden)),
                       shape_note="as the dispatch delivered", device=dev)
        if topk_weights is not None:
            if handle.num_topk == 0:
                raise ArgumentError(with_rank("topk_weights given but the dispatch had no topk_idx"))
            w_info = check(topk_weights, "topk_weights", dtype="float32",
                           shape=(("rows", handle.num_rows), ("K", handle.num_topk)), device=dev)
            topk_weights = kernel_array(topk_weights, w_info, "topk_weights")
        biases = tuple(bias) if isinstance(bias, (tuple, list)) else (() if bias is None else (bias,))
        if not 0 <= len(biases) <= 2:
            raise ArgumentError(with_rank(f"bias must be one array or a pair, got {len(biases)}"))
        biases = tuple(kernel_array(b, check(b, f"bias[{i}]", dtype="bfloat16", shape=(
            ("N", handle.num_tokens), ("H", handle.hidden)), device=dev), f"bias[{i}]") for i, b in enumerate(biases))
        config = self._resolve_config(config, self.combine_config, handle.num_channels, "the dispatch")
        self._check_need(config, handle.hidden, handle.num_topk, 0, False, "combine")
        kind = "torch" if y_info.framework == "torch" and previous_event is None else "cupy"
        spec = self._spec_of(config)
        plan = self.ops.combine_plan(y_info.framework, kind, self._combine_fp8_spec(spec) if fp8 else spec, config,
                                     handle, topk_weights is not None)
        if not isinstance(bias, (tuple, list)):
            biases = bias if bias is None else biases[0]  # type: ignore[assignment]
        return self.plans.remember(key, plan), kernel_array(y, y_info, "y"), topk_weights, biases

    _combine_fp8_spec = staticmethod(combine_fp8_spec)  # the FP8 combine of this family's spec

    def _check_combine_fp8(self, hidden: int) -> None:
        """Refuse an FP8 combine of rows it cannot quantise (a scale a 128 channels)."""
        if hidden % 128:
            raise ArgumentError(with_rank(f"combine with use_fp8=True needs hidden % 128 == 0 (a scale a 128 "
                                          f"channels), but the dispatch's hidden is {hidden}"))

    # ------------------------------------------------------------------------------------------------ jax.jit

    def xla_dispatch_site(self, num_tokens: int, hidden: int, num_topk: int, num_experts: int, num_worst_tokens: int,
                          fp8: bool, replay: bool) -> NormalDispatchSite:
        """A worst-token dispatch inside an XLA program (epjit.ops.xla), its static sizes checked as dispatch checks
        them; ``replay``: of a handle's routing (no topk_idx)."""
        if self.shrink:
            raise ArgumentError(with_rank("a Buffer made with enable_shrink=True has no jitted normal-mode calls"))
        if num_worst_tokens <= 0:
            raise ArgumentError(with_rank(f"a jitted dispatch needs num_worst_tokens > 0 (its rows are the output's "
                                          f"shape), got {num_worst_tokens}"))
        if hidden % 8 or hidden <= 0 or (fp8 and hidden % 128):
            raise ArgumentError(with_rank(f"hidden={hidden} must be a positive multiple of 8 (16-byte rows), of 128 "
                                          "for FP8"))
        if not 1 <= num_topk <= 32:
            raise ArgumentError(with_rank(f"topk_idx has {num_topk} columns; 1 to 32 are supported"))
        num_experts = self._check_num_experts(num_experts)
        config = self.dispatch_config
        self._check_need(config, hidden, num_topk, num_experts, fp8, "dispatch")
        records = self.ops.records
        if host_record_bytes(self.num_ranks, num_experts, records.forwarded) > records.graph.num_bytes:
            raise ArgumentError(with_rank(f"a jitted dispatch takes up to 4096 experts (or the Buffer's "
                                          f"num_experts), got {num_experts}"))
        shape = DispatchShape("jax", "cupy", num_tokens, hidden, num_topk, fp8, not replay, not replay, num_experts,
                              num_worst_tokens, 1, replay)
        plan = self.ops.dispatch_plan(shape, self._spec_of(config), config)
        parts = HandleParts.of(self.num_ranks, config.num_channels, num_tokens, num_worst_tokens)
        layout = None if replay else layout_plan(self.layout_ops, num_tokens, num_topk, num_experts)
        return NormalDispatchSite(self, plan, layout, parts, replay)

    def xla_combine_site(self, sizes: HandleSizes, num_worst_tokens: int, with_weights: bool) -> NormalCombineSite:
        """A combine inside an XLA program on a jitted dispatch's handle of these sizes."""
        config = self._resolve_config(None, self.combine_config, sizes.num_channels, "the dispatch")
        self._check_need(config, sizes.hidden, sizes.num_topk, 0, False, "combine")
        plan = self.ops.combine_plan("jax", "cupy", self._spec_of(config), config, sizes, with_weights)
        parts = HandleParts.of(self.num_ranks, sizes.num_channels, sizes.num_tokens, num_worst_tokens)
        return NormalCombineSite(plan, parts, sizes, with_weights)

    # ------------------------------------------------------------------------------------------------ shrink

    def _shrinking(self, call: str) -> NormalShrinkMask:
        shrink = self.ops.shrink
        if shrink is None:
            raise ArgumentError(with_rank(f"{call} needs a Buffer made with enable_shrink=True"))
        return shrink

    def update_mask(self, rank_to_mask: Any, mask: Any) -> None:
        shrink = self._shrinking("update_mask")
        rank = check_rank_to_mask(rank_to_mask, self.num_ranks)
        if rank == self.res.group.rank:
            raise ArgumentError(with_rank(f"rank_to_mask={rank} is this rank: a rank masks its peers"))
        shrink.update(rank, check_flag(mask, "mask"))

    def query_mask(self, mask_status: Any) -> None:
        shrink = self._shrinking("query_mask")
        info = check(mask_status, "mask_status", dtype="int32", shape=(self.num_ranks,), device=self.device)
        shrink.query(address(kernel_array(mask_status, info, "mask_status")), info.framework)

    def clean_mask(self) -> None:
        """Collective: every rank of the group, live, with no normal-mode call in flight."""
        shrink = self._shrinking("clean_mask")
        self.res.mem.synchronize(self.res.streams.comm)
        self.res.group.barrier()
        shrink.clean()
        self.res.group.barrier()

    def mask_reports(self) -> list[dict[str, Any]]:
        return self._shrinking("mask_reports").mask_reports()


class InternodeFront(IntranodeFront):
    """Normal mode of a Buffer whose group spans several NVLink nodes."""

    def _ops(self, res: Resources) -> Internode:
        return Internode(res.mem, res.streams, res.outputs, res.profile, self.device, res.num_experts,
                         expert_cap(res.num_experts))

    def _per_node(self, layout: DispatchLayout) -> Any:
        return self._hand_made(layout.num_tokens_per_rdma_rank, "num_tokens_per_rdma_rank", dtype="int32",
                               shape=(self.num_ranks // self.num_nvl_ranks,))

    def _spec_of(self, config: Config) -> Any:
        return config.internode_spec(self.num_ranks, self.num_nvl_ranks)

    _combine_fp8_spec = staticmethod(internode_combine_fp8_spec)

    def xla_dispatch_site(self, *args: Any, **kwargs: Any) -> NormalDispatchSite:
        raise ArgumentError(with_rank("jitted normal-mode calls run inside one NVLink node; this Buffer's group "
                                      "spans several (use low-latency mode across nodes)"))

    xla_combine_site = xla_dispatch_site  # type: ignore[assignment]

    def _check_need(self, config: Config, hidden: int, num_topk: int, num_experts: int, fp8: bool,
                    what: str) -> None:
        res = self.res
        check_internode_need(config, self.num_ranks, self.num_nvl_ranks, hidden, num_topk, num_experts,
                             self.num_experts, (res.num_nvl_bytes, res.num_rdma_bytes), what,
                             res.low_latency_heap_bytes)
