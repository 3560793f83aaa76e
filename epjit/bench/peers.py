"""The peers a case is timed beside, in the same processes, on the same inputs, with the same protocol
(docs/benchmark.md): NCCL's ``all_to_all_single`` moving the same bytes, and DeepEP V1 (deepseek-ai/DeepEP at
567632d, built from source and importable as ``deep_ep``) making the same calls.

DeepEP runs over ``torch.distributed``'s default group, the NCCL group the benchmark starts over epjit's ranks.
``DeepEPPeer`` makes each of DeepEP's Buffers the first time a case of its family is timed, sized by DeepEP's own
hints, and destroys it when that family is done (``close_normal``, ``close_low_latency``, ``close``):

- normal mode: one intranode Buffer, ``num_nvl_bytes`` the largest ``Config.get_nvl_buffer_size_hint(2 * hidden,
  ranks)`` over the dispatch and combine configs of the run's SM counts. A case's Config is DeepEP's default for
  the operation and rank count (``Buffer.get_dispatch_config`` / ``get_combine_config``) with ``num_sms`` the
  case's SM count (DeepEP's getters read the class-wide ``Buffer.num_sms``, set through ``set_num_sms`` for the
  call and put back). DeepEP runs ``num_sms / 2`` channels of two SMs each, epjit one a channel: the same SMs.
- low latency: one Buffer of ``get_low_latency_rdma_size_hint(max tokens, hidden, ranks, experts)`` bytes with
  ``num_qps_per_rank = experts / ranks``, as DeepEP's README makes it. Before it is made, ``DEEPEP_IBGDA=0`` and
  ``NVSHMEM_REMOTE_TRANSPORT=none`` are set unless already set (DEEPEP_ENV_DEFAULTS): GPUs of one host need no NIC.

A DeepEP call that raises (an SM count or a shape DeepEP refuses) leaves its cell empty: every rank learns every
rank's outcome (an allgather) and all take the same decision, and rank 0 prints why.
"""

from __future__ import annotations

import importlib
import inspect
import os
import sys
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any, TypeVar

T = TypeVar("T")

# What --peers offers: each case is timed beside these, in the same processes, on the same inputs.
PEERS = ("nccl", "deepep")

# Set (unless already set) before DeepEP's low-latency Buffer starts NVSHMEM. Upstream DeepEP asks NVSHMEM for IBGDA
# in low-latency mode, whose start fails without an RDMA NIC; a DeepEP that reads DEEPEP_IBGDA (a one-line patch of
# deep_ep/buffer.py) skips it, and with no remote transport every peer is reached over NVLink.
DEEPEP_ENV_DEFAULTS = {"DEEPEP_IBGDA": "0", "NVSHMEM_REMOTE_TRANSPORT": "none"}

DEEPEP_FIX = ("build DeepEP V1 from source (deepseek-ai/DeepEP at 567632d, `python setup.py build_ext --inplace`) "
              "and put its folder on PYTHONPATH")

# What the benchmark calls on DeepEP's Buffer: its V1 API (a later DeepEP rewrote it).
_DEEPEP_CALLS = ("get_dispatch_layout", "dispatch", "combine", "low_latency_dispatch", "low_latency_combine",
                 "clean_low_latency_buffer", "get_dispatch_config", "get_combine_config", "set_num_sms",
                 "get_low_latency_rdma_size_hint")

_EPJIT_PACKAGE = Path(__file__).resolve().parents[1]


def deepep_problem() -> str | None:
    """Why ``--peers deepep`` cannot run in this process, or None: ``deep_ep`` must import, be DeepEP's own (not
    epjit's alias of it, ``epjit.deep_ep.install()``) and have the V1 Buffer. Every rank finds the same answer."""
    found = sys.modules.get("deep_ep")
    if found is not None and found is sys.modules.get("epjit.deep_ep"):  # epjit.deep_ep.installed()
        return ("--peers deepep: deep_ep is epjit's own alias in this process (epjit.deep_ep.install()), not DeepEP: "
                f"{DEEPEP_FIX}, and time it in a process that does not install the alias")
    try:
        module = importlib.import_module("deep_ep")
    except Exception as e:  # noqa: BLE001 - ImportError, or its extension failing to load (OSError, RuntimeError)
        return f"--peers deepep: `import deep_ep` failed ({type(e).__name__}: {e}): {DEEPEP_FIX}"
    where = getattr(module, "__file__", None)
    if where and Path(where).resolve().is_relative_to(_EPJIT_PACKAGE):
        return (f"--peers deepep: deep_ep is {where}, inside epjit (its DeepEP-compatible API), not DeepEP: "
                f"{DEEPEP_FIX}")
    missing = [name for name in _DEEPEP_CALLS if not hasattr(getattr(module, "Buffer", None), name)]
    if missing:
        return (f"--peers deepep: deep_ep ({where}) has no Buffer.{', Buffer.'.join(missing)}: not DeepEP's V1 API; "
                f"{DEEPEP_FIX}")
    return None


def nccl_case_us(dist: Any, group: Any, mode: str, row_bytes: int, send_counts: list[int], recv_counts: list[int],
                 repeat: int) -> float:
    """NCCL all_to_all_single moving a normal-mode case's rows (bf16, or FP8 rows as uint8) with its split sizes;
    ``mode`` is the operation (dispatch, dispatch-fp8 or combine)."""
    import torch

    from .protocol import median_us

    fp8 = mode == "dispatch-fp8"
    cols, dtype = (row_bytes, torch.uint8) if fp8 else (row_bytes // 2, torch.bfloat16)
    in_split, out_split = (recv_counts, send_counts) if mode == "combine" else (send_counts, recv_counts)
    inp = torch.empty(sum(in_split), cols, dtype=dtype, device="cuda")
    out = torch.empty(sum(out_split), cols, dtype=dtype, device="cuda")
    return median_us(lambda: dist.all_to_all_single(out, inp, out_split, in_split), group, repeat)


def nccl_bytes_us(dist: Any, group: Any, send_rows: list[int], recv_rows: list[int], row_bytes: int,
                  repeat: int) -> float:
    """NCCL all_to_all_single moving these rows of ``row_bytes`` bytes (as uint8)."""
    import torch

    from .protocol import median_us

    inp = torch.empty(sum(send_rows), row_bytes, dtype=torch.uint8, device="cuda")
    out = torch.empty(sum(recv_rows), row_bytes, dtype=torch.uint8, device="cuda")
    return median_us(lambda: dist.all_to_all_single(out, inp, recv_rows, send_rows), group, repeat)


def attempt(group: Any, what: str, fn: Callable[[], T]) -> T | None:
    """``fn()``, or None on every rank of ``group`` (epjit's) where it raised on any; rank 0 says why. Every rank must
    reach this with the same ``what``: DeepEP refuses a case on the host, before its kernels start, the same way on
    all ranks, so none is left waiting in a kernel for a peer that gave up."""
    try:
        value, error = fn(), None
    except Exception as e:  # noqa: BLE001 - DeepEP refuses with AssertionError or RuntimeError; the row stays
        value, error = None, f"{type(e).__name__}: {e}".splitlines()[0]
    failed = [(rank, e) for rank, e in enumerate(group.allgather_object(error)) if e is not None]
    if not failed:
        return value
    if group.rank == 0:
        rank, error = failed[0]
        print(f"DeepEP {what}: not timed (rank {rank}: {error})", flush=True)
    return None


def _destroy(buffer: Any) -> None:
    """Release a DeepEP Buffer: ``destroy()`` where it was made to be destroyed explicitly, else its destructor
    (once the last reference goes)."""
    if buffer is not None and getattr(buffer, "explicitly_destroy", False) and hasattr(buffer, "destroy"):
        buffer.destroy()


class DeepEPPeer:
    """DeepEP's Buffers for one benchmark run, and its figure for each case (None where DeepEP refused the case)."""

    def __init__(self, group: Any, deep_ep: Any = None, torch_group: Any = None) -> None:
        """``group``: epjit's (the rank, the allgathers, the timing protocol's barrier); ``deep_ep``: the module
        (default: ``import deep_ep``); ``torch_group``: DeepEP's group (default: torch.distributed's default group,
        the NCCL group the benchmark starts over the same ranks)."""
        self.deep_ep = deep_ep if deep_ep is not None else importlib.import_module("deep_ep")
        self.group = group
        self.torch_group = torch_group
        self.normal: Any = None
        self.low_latency: Any = None
        self.ll_sizes = (0, 0, 0)  # the low-latency Buffer's (max tokens a rank, hidden, experts)

    # ---------------------------------------------------------------------------------------------- the Buffers

    def _buffer(self, num_nvl_bytes: int, num_rdma_bytes: int, **kwargs: Any) -> Any:
        if self.torch_group is None:
            import torch.distributed as dist

            self.torch_group = dist.group.WORLD
        cls = self.deep_ep.Buffer
        if "explicitly_destroy" in inspect.signature(cls.__init__).parameters:
            kwargs["explicitly_destroy"] = True  # destroyed in close(), not by a destructor at exit
        return cls(self.torch_group, num_nvl_bytes, num_rdma_bytes, **kwargs)

    def config(self, operation: str, num_sms: int) -> Any:
        """DeepEP's default Config of ``operation`` (dispatch or combine) for the rank count, on ``num_sms`` SMs.
        Raises DeepEP's AssertionError for an SM count it refuses (odd) or a rank count it has no default for."""
        cls = self.deep_ep.Buffer
        saved = cls.num_sms
        try:
            cls.set_num_sms(num_sms)
            getter = cls.get_combine_config if operation == "combine" else cls.get_dispatch_config
            return getter(self.group.size)
        finally:
            cls.num_sms = saved

    def open_normal(self, hidden: int, sms_counts: list[int]) -> None:
        """Make the normal-mode Buffer, for every SM count of the run at hidden size ``hidden`` (the largest)."""

        def make() -> Any:
            sizes = []
            for sms in sorted(set(sms_counts)):
                for operation in ("dispatch", "combine"):
                    try:
                        cfg = self.config(operation, sms)
                    except AssertionError:
                        continue  # a count DeepEP refuses: the cases at it say why
                    sizes.append(cfg.get_nvl_buffer_size_hint(2 * hidden, self.group.size))
            if not sizes:
                raise ValueError(f"DeepEP has a config for none of the SM counts {sorted(set(sms_counts))} on "
                                 f"{self.group.size} ranks")
            if self.group.rank == 0:
                print(f"DeepEP normal-mode buffer: {max(sizes) / 2**20:.1f} MiB a rank", flush=True)
            return self._buffer(max(sizes), 0)

        self.normal = self.attempt("normal-mode Buffer", make)

    def open_low_latency(self, max_tokens: int, hidden: int, num_experts: int) -> None:
        """Make the low-latency Buffer for up to ``max_tokens`` tokens a rank."""
        for name, value in DEEPEP_ENV_DEFAULTS.items():
            os.environ.setdefault(name, value)

        def make() -> Any:
            r = self.group.size
            size = self.deep_ep.Buffer.get_low_latency_rdma_size_hint(max_tokens, hidden, r, num_experts)
            if self.group.rank == 0:
                print(f"DeepEP low-latency buffer: {size / 2**20:.1f} MiB a rank (DEEPEP_IBGDA="
                      f"{os.environ['DEEPEP_IBGDA']}, NVSHMEM_REMOTE_TRANSPORT="
                      f"{os.environ['NVSHMEM_REMOTE_TRANSPORT']})", flush=True)
            return self._buffer(0, size, low_latency_mode=True, num_qps_per_rank=num_experts // r)

        self.low_latency = self.attempt("low-latency Buffer", make)
        self.ll_sizes = (max_tokens, hidden, num_experts)

    def close_normal(self) -> None:
        buffer, self.normal = self.normal, None
        _destroy(buffer)

    def close_low_latency(self) -> None:
        buffer, self.low_latency = self.low_latency, None
        _destroy(buffer)

    def close(self) -> None:
        try:
            self.close_low_latency()
        finally:
            self.close_normal()

    def attempt(self, what: str, fn: Callable[[], T]) -> T | None:
        return attempt(self.group, what, fn)

    # ---------------------------------------------------------------------------------------------- normal mode

    def normal_us(self, mode: str, x: Any, topk_idx: Any, topk_weights: Any, num_experts: int, num_sms: int,
                  repeat: int) -> float | None:
        """DeepEP's median for a normal-mode row, None where it has no normal Buffer or refused the case."""
        if self.normal is None:
            return None
        rows = x[0] if isinstance(x, tuple) else x
        what = f"{mode} {rows.shape[0]}x{rows.shape[1]} at {num_sms} SMs"
        return self.attempt(what, lambda: self._normal_us(mode, x, topk_idx, topk_weights, num_experts, num_sms,
                                                          repeat))

    def _normal_us(self, mode: str, x: Any, topk_idx: Any, topk_weights: Any, num_experts: int, num_sms: int,
                   repeat: int) -> float:
        from .protocol import median_us

        buf = self.normal
        dispatch_config = self.config("dispatch", num_sms)

        def dispatch(layout: tuple[Any, ...]) -> tuple[Any, ...]:
            per_rank, per_rdma_rank, per_expert, in_rank, _ = layout
            return buf.dispatch(x, num_tokens_per_rank=per_rank, num_tokens_per_rdma_rank=per_rdma_rank,
                                is_token_in_rank=in_rank, num_tokens_per_expert=per_expert, topk_idx=topk_idx,
                                topk_weights=topk_weights, config=dispatch_config)

        layout = buf.get_dispatch_layout(topk_idx, num_experts)
        if mode == "combine":  # epjit's combine row passes no weights either: the rows alone, summed
            recv_x, _, _, _, handle, _ = dispatch(layout)
            combine_config = self.config("combine", num_sms)
            return median_us(lambda: buf.combine(recv_x, handle, config=combine_config), self.group, repeat)
        if mode.startswith("cached-"):  # the handle's routing replayed: no layout, no count exchange, no host wait
            handle = dispatch(layout)[4]
            return median_us(lambda: buf.dispatch(x, handle=handle, config=dispatch_config), self.group, repeat)
        if mode.startswith("layout-"):  # the call as a user makes it with a fresh routing
            return median_us(lambda: dispatch(buf.get_dispatch_layout(topk_idx, num_experts)), self.group, repeat)
        return median_us(lambda: dispatch(layout), self.group, repeat)

    # ---------------------------------------------------------------------------------------------- low latency

    def low_latency_us(self, modes: list[str], x: Any, topk_idx: Any, topk_weights: Any, y: Any,
                       repeat: int, logfmt_y_scale: float = 0.1) -> dict[str, float | None]:
        """DeepEP's medians for a low-latency case, keyed as epjit's rows (ll-dispatch, ll-combine, ll-combine-logfmt
        on y x logfmt_y_scale, and with ll-hook ll-dispatch-send, ll-dispatch-recv, ll-combine-send,
        ll-combine-recv); empty without a Buffer."""
        buf = self.low_latency
        if buf is None:
            return {}
        max_tokens, hidden, num_experts = self.ll_sizes
        tokens = topk_idx.shape[0]

        def dispatch(hook: bool = False) -> tuple[Any, ...]:
            return buf.low_latency_dispatch(x, topk_idx, max_tokens, num_experts, use_fp8=True, return_recv_hook=hook)

        handle = self.attempt(f"ll-dispatch {tokens} tokens", lambda: dispatch()[2])
        if handle is None:
            return {}
        y_small = y * logfmt_y_scale if "ll-combine-logfmt" in modes else y
        calls = {"ll-dispatch": dispatch,
                 "ll-combine": lambda hook=False: buf.low_latency_combine(y, topk_idx, topk_weights, handle,
                                                                          return_recv_hook=hook),
                 "ll-combine-logfmt": lambda hook=False: buf.low_latency_combine(
                     y_small, topk_idx, topk_weights, handle, use_logfmt=True, return_recv_hook=hook)}
        times: dict[str, float | None] = {}
        for name, call in calls.items():
            if name in modes:
                times[name] = self.attempt(f"{name} {tokens} tokens", lambda call=call: self._graph_us(call, repeat))
            if "ll-hook" in modes and name != "ll-combine-logfmt":
                halves = self.attempt(f"{name} {tokens} tokens, hook halves",
                                      lambda call=call: self._halves_us(call, repeat))
                times[f"{name}-send"], times[f"{name}-recv"] = halves or (None, None)
        return times

    def _clean(self) -> None:
        """DeepEP's low-latency calls alternate between two buffers, each call zeroing the other's arrival counters
        for the next one; a graph of one call replays on the same buffer every time, so before each replay (outside
        the timed span) its counters are zeroed as the call before it would have left them."""
        self.low_latency.clean_low_latency_buffer(*self.ll_sizes)

    def _graph_us(self, call: Callable[..., Any], repeat: int) -> float:
        from .protocol import graph_us

        return graph_us(call, self.group, repeat, before=self._clean)

    def _halves_us(self, call: Callable[..., Any], repeat: int) -> tuple[float, float]:
        from .protocol import hook_halves_us

        # DeepEP returns its receive hook as the last element of the call's result
        return hook_halves_us(lambda: SimpleNamespace(hook=call(True)[-1]), self.group, repeat, before=self._clean)
