"""Config: how many SMs and how large the chunks of the normal-mode kernels are, and buffer size hints.

Pure Python (no GPU): the heuristics are unit-tested on the CPU.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .errors import ArgumentError, ArgumentTypeError, check_flag, check_int, with_rank
from .kernels import internode
from .kernels.intranode import (
    NUM_THREADS,
    IntranodeSpec,
    intranode_min_nvl_bytes,
    intranode_nvl_bytes,
    intranode_spec,
)

MAX_CHANNELS = 128  # every Buffer reserves control words for this many channels

# At most this many reader warps of a combine block (one warp coordinates, the others read or send): a ring must
# hold a whole chunk beyond the rows those readers may be waiting on at once, or the sender could wait for room
# that never frees.
COMBINE_READERS = NUM_THREADS // 32 - 1


@dataclass(frozen=True)
class Config:
    """SMs (one block a channel: each sends, receives and copies its share) and chunk sizes in tokens.

    nvl_chunk_send: tokens a sender pushes between tail updates; nvl_chunk_recv: ring slots per (channel, rank).
    Across NVLink nodes (two blocks a channel, so num_sms / 2 channels, as DeepEP): rdma_chunk_send messages a put
    carries (a chunk) and rdma_chunk_recv slots of an RDMA ring per (channel, node); nvl_chunk_recv slots of an
    NVLink ring per (channel, node peer), which combine cuts into one sub-ring a node, and nvl_chunk_send rows a
    combine sender moves between tail updates. Inside one node the rdma fields are unused.

    Tuning knobs of the normal-mode kernels' warp roles (0 / False: the default for the rank count, see
    epjit.kernels.intranode): dispatch_send_warps and dispatch_drain_warps (a peer each; the own copy gets the warps
    they leave), combine_send_warps (a peer), dispatch_phased (one sending group serves the peers one at a time, in
    turn, instead of a group a peer). Each set of roles is a kernel of its own, compiled on first use.
    """

    num_sms: int = 24
    nvl_chunk_send: int = 6
    nvl_chunk_recv: int = 256
    rdma_chunk_send: int = 6
    rdma_chunk_recv: int = 128
    dispatch_send_warps: int = 0
    dispatch_drain_warps: int = 0
    combine_send_warps: int = 0
    dispatch_phased: bool = False

    def __post_init__(self) -> None:
        # Stored as the int (a NumPy integer would hash and print as itself in every plan key and message).
        for name in ("num_sms", "nvl_chunk_send", "nvl_chunk_recv", "rdma_chunk_send", "rdma_chunk_recv",
                     "dispatch_send_warps", "dispatch_drain_warps", "combine_send_warps"):
            object.__setattr__(self, name, check_int(getattr(self, name), f"Config.{name}", None))
        object.__setattr__(self, "dispatch_phased", check_flag(self.dispatch_phased, "Config.dispatch_phased"))
        for name in ("dispatch_send_warps", "dispatch_drain_warps", "combine_send_warps"):
            if getattr(self, name) < 0:
                raise ArgumentError(with_rank(f"Config.{name}={getattr(self, name)} must be >= 0 (0: the default)"))
        # Frozen dataclasses hash every field on every hash; a Config keys the plan caches of every call.
        object.__setattr__(self, "_hash", hash((self.num_sms, self.nvl_chunk_send, self.nvl_chunk_recv,
                                                self.rdma_chunk_send, self.rdma_chunk_recv,
                                                tuple(sorted(self.roles().items())))))
        if not 1 <= self.num_sms <= MAX_CHANNELS:
            raise ArgumentError(with_rank(f"Config.num_sms={self.num_sms} must be in [1, {MAX_CHANNELS}] "
                                          "(one block a channel)"))
        for name in ("nvl_chunk_send", "rdma_chunk_send", "rdma_chunk_recv"):
            if getattr(self, name) < 1:
                raise ArgumentError(with_rank(f"Config.{name}={getattr(self, name)} must be >= 1"))
        if self.nvl_chunk_recv < self.nvl_chunk_send + COMBINE_READERS:
            raise ArgumentError(with_rank(
                f"Config.nvl_chunk_recv={self.nvl_chunk_recv} must be >= nvl_chunk_send + {COMBINE_READERS} "
                f"= {self.nvl_chunk_send + COMBINE_READERS}: a ring holds a chunk beyond what every combine "
                "reader warp may wait on"))

    def __hash__(self) -> int:
        return self._hash  # type: ignore[attr-defined, no-any-return]

    @property
    def num_channels(self) -> int:
        return self.num_sms

    def roles(self) -> dict[str, int]:
        """The warp-role fields set (non-default), as IntranodeSpec overrides."""
        roles = {name: getattr(self, name) for name in ("dispatch_send_warps", "dispatch_drain_warps",
                                                        "combine_send_warps") if getattr(self, name)}
        if self.dispatch_phased:
            roles["dispatch_phased"] = 1
        return roles

    def spec(self, num_ranks: int) -> IntranodeSpec:
        """The dispatch/combine kernel of these warp roles on this many ranks (ValueError if they cannot be)."""
        return intranode_spec(check_int(num_ranks, "num_ranks", 1), NUM_THREADS, **self.roles())

    def nvl_bytes(self, num_ranks: int, hidden: int, num_topk: int, num_experts: int, fp8: bool) -> int:
        """Bytes of NVLink buffer payload a normal-mode call with these sizes needs."""
        num_ranks, hidden = check_int(num_ranks, "num_ranks", 1), check_int(hidden, "hidden", 1)
        num_topk, num_experts = check_int(num_topk, "num_topk"), check_int(num_experts, "num_experts")  # combine: 0
        fp8 = check_flag(fp8, "fp8")
        return intranode_nvl_bytes(num_ranks, self.num_channels, self.nvl_chunk_recv, hidden, num_topk,
                                   hidden // 128 if fp8 else 0, num_experts // num_ranks)

    def internode_bytes(self, num_ranks: int, num_nvl_ranks: int, hidden: int, num_topk: int,
                        num_experts: int) -> tuple[int, int]:
        """(NVLink payload, symmetric heap) bytes an internode call with these sizes needs (bf16 and FP8 alike:
        a slot holds a bf16 row). num_experts beyond the notify areas' EXPERT_CAP widen them."""
        num_ranks, num_nvl_ranks = check_int(num_ranks, "num_ranks", 1), check_int(num_nvl_ranks, "num_nvl_ranks", 1)
        hidden, num_topk = check_int(hidden, "hidden", 1), check_int(num_topk, "num_topk")
        nodes, cap, channels = num_ranks // num_nvl_ranks, expert_cap(check_int(num_experts, "num_experts")), \
            self.num_sms // 2
        return (internode.internode_nvl_bytes(num_ranks, nodes, cap, channels, self.nvl_chunk_recv, hidden, num_topk),
                internode.internode_rdma_bytes(num_ranks, nodes, cap, channels, self.rdma_chunk_recv, hidden,
                                               num_topk))

    def internode_spec(self, num_ranks: int, num_nvl_ranks: int) -> internode.InternodeSpec:
        """The internode kernels for this topology; ArgumentError naming what this Config cannot run with."""
        nodes = num_ranks // num_nvl_ranks
        try:
            spec = internode.internode_spec(nodes, num_nvl_ranks)
        except ValueError as e:
            raise ArgumentError(with_rank(f"{num_ranks} ranks in nodes of {num_nvl_ranks}: {e}")) from None
        if self.roles():
            raise ArgumentError(with_rank(f"Config's warp-role fields ({self.roles()}) tune the intranode kernels; "
                                          "across NVLink nodes leave them 0"))
        problems = internode.config_problems(self.num_sms, self.nvl_chunk_send, self.nvl_chunk_recv,
                                             self.rdma_chunk_send, self.rdma_chunk_recv, nodes, spec)
        if problems:
            raise ArgumentError(with_rank(f"{self} cannot run across {nodes} nodes of {num_nvl_ranks}: "
                                          + "; ".join(problems)))
        return spec


def expert_cap(num_experts: int) -> int:
    """Experts the internode notify areas hold: EXPERT_CAP, or a Buffer's num_experts if larger."""
    return max(internode.EXPERT_CAP, num_experts)


def _default_spec(num_ranks: int) -> IntranodeSpec:
    """The default warp roles for a rank count a caller gave (ArgumentError naming it where there are none)."""
    num_ranks = check_int(num_ranks, "num_ranks", 1)
    try:
        return intranode_spec(num_ranks)
    except ValueError as e:
        raise ArgumentError(with_rank(f"num_ranks={num_ranks}: {e}")) from None


def internode_config(num_ranks: int, num_nvl_ranks: int) -> Config:
    """Defaults across NVLink nodes (dispatch and combine alike): 24 SMs (12 channels of two blocks), RDMA chunks of
    8 messages in rings of 128 slots (16 chunks: a put per chunk keeps several in flight while a ring holds a
    window of senders' tokens beyond two chunks), and NVLink rings of DeepEP's 288 slots (more where many nodes cut
    combine's sub-rings smaller than a chunk of 8 rows plus a forwarding group's round of chunks)."""
    num_ranks, num_nvl_ranks = check_int(num_ranks, "num_ranks", 1), check_int(num_nvl_ranks, "num_nvl_ranks", 1)
    nodes = num_ranks // num_nvl_ranks
    spec = internode.internode_spec(nodes, num_nvl_ranks)
    return Config(24, 8, max(288, nodes * (8 + 8 * spec.combine_group_warps)), 8, 128)


def _several_nodes(num_ranks: int, num_nvl_ranks: int | None) -> bool:
    if num_nvl_ranks is None:
        return False
    num_nvl_ranks = check_int(num_nvl_ranks, "num_nvl_ranks", 1)
    if num_ranks % num_nvl_ranks:
        raise ArgumentError(with_rank(f"num_nvl_ranks={num_nvl_ranks} does not divide num_ranks={num_ranks}"))
    return num_nvl_ranks < num_ranks


def get_dispatch_config(num_ranks: int, spec: IntranodeSpec | None = None, num_nvl_ranks: int | None = None) -> Config:
    """Defaults for dispatch, by rank count (and the kernel's warp roles: ``spec``, default
    ``intranode_spec(num_ranks)``): 24 channels (one SM each), and chunks of four tokens a warp of a sending group
    between tail updates, at least 12. Each tail update is a system-scope release that stalls the group even with
    nothing outstanding, so a chunk must outweigh it (docs/history.md, "Rings and chunks"). 2 ranks: 10 warps a
    peer, chunks of 40; 4 ranks: 4 warps a peer, 16 (phased, 12 warps in one group: 48)."""
    if _several_nodes(num_ranks, num_nvl_ranks):
        return internode_config(num_ranks, num_nvl_ranks)  # type: ignore[arg-type]
    spec = spec or _default_spec(num_ranks)
    return Config(24, max(12, 4 * spec.dispatch_group_send_warps), 256)


def get_combine_config(num_ranks: int, spec: IntranodeSpec | None = None, num_nvl_ranks: int | None = None) -> Config:
    """Defaults for combine, by rank count (and the kernel's sending warps: ``spec``): the same channels as dispatch
    (combine replays its channels), and chunks of about 12 rows, rounded up to a whole number of rows a sending
    warp: a combine reader waits for the chunk holding its token's row, so large chunks leave the readers a chunk
    behind the senders (dispatch's drains copy rows as they come and take larger chunks; docs/history.md, "Rings
    and chunks"). 2 ranks: 14 rows; 4 and 8 ranks: 12."""
    if _several_nodes(num_ranks, num_nvl_ranks):
        return internode_config(num_ranks, num_nvl_ranks)  # type: ignore[arg-type]
    senders = max(1, (spec or _default_spec(num_ranks)).combine_send_warps)
    return Config(24, -(-12 // senders) * senders, 256)


def normal_size_hint(num_ranks: int, hidden: int, num_topk: int = 8, num_experts: int = 256,
                     config: Config | None = None, num_nvl_ranks: int | None = None) -> int:
    """num_nvl_bytes a Buffer needs for normal-mode dispatch (bf16 or FP8) and combine with these sizes (each
    config's nvl_bytes checks them); across nodes (num_nvl_ranks < num_ranks), the internode kernels' NVLink part."""
    config_key(config)  # refuses anything but a Config, naming it
    if _several_nodes(check_int(num_ranks, "num_ranks", 1), num_nvl_ranks):
        return max(c.internode_bytes(num_ranks, num_nvl_ranks, hidden, num_topk, num_experts)[0]  # type: ignore
                   for c in _configs(num_ranks, config, num_nvl_ranks))
    configs = [config] if config is not None else [get_dispatch_config(num_ranks), get_combine_config(num_ranks)]
    return max(c.nvl_bytes(num_ranks, hidden, num_topk, num_experts, fp8) for c in configs for fp8 in (False, True))


def rdma_size_hint(num_ranks: int, hidden: int, num_topk: int = 8, num_experts: int = 256,
                   config: Config | None = None, num_nvl_ranks: int | None = None) -> int:
    """num_rdma_bytes (symmetric heap) normal mode needs across nodes (0 inside one NVLink node)."""
    config_key(config)
    if not _several_nodes(check_int(num_ranks, "num_ranks", 1), num_nvl_ranks):
        return 0
    return max(c.internode_bytes(num_ranks, num_nvl_ranks, hidden, num_topk, num_experts)[1]  # type: ignore
               for c in _configs(num_ranks, config, num_nvl_ranks))


def _configs(num_ranks: int, config: Config | None, num_nvl_ranks: int | None) -> list[Config]:
    if config is not None:
        return [config]
    return [get_dispatch_config(num_ranks, num_nvl_ranks=num_nvl_ranks),
            get_combine_config(num_ranks, num_nvl_ranks=num_nvl_ranks)]


def config_key(config: Any) -> Any:
    """``config`` as part of a plan's key: () for None. Anything but a Config is refused here, naming the argument
    (a dict would fail the plan lookup with a bare "unhashable" TypeError)."""
    if config is None:
        return ()
    if not isinstance(config, Config):
        raise ArgumentTypeError(with_rank(f"config must be an epjit.Config, got {type(config).__name__}"))
    return config


def check_normal_sizes(num_ranks: int, num_nvl_ranks: int, num_nvl_bytes: int, num_rdma_bytes: int,
                       num_experts: int, low_latency_bytes: int = 0) -> None:
    """A normal-mode Buffer's sizes (the same on every rank): enough for the control words any call needs. Across
    nodes, ``low_latency_bytes``: what low-latency mode takes of num_rdma_bytes after normal mode's region (a Buffer
    serving both)."""
    if num_nvl_ranks == num_ranks:
        minimum = intranode_min_nvl_bytes(num_ranks, MAX_CHANNELS)
        if num_nvl_bytes < minimum:
            raise ArgumentError(with_rank(
                f"num_nvl_bytes={num_nvl_bytes} is below the {minimum} bytes of control words every call "
                f"needs; Buffer.get_normal_size_hint(...) gives a size for given shapes"))
        return
    nodes, cap = num_ranks // num_nvl_ranks, expert_cap(num_experts)
    minimum = (internode.nvl_fixed_bytes(num_ranks, nodes, cap), internode.heap_fixed_bytes(num_ranks, nodes, cap))
    for name, given, least in (("num_nvl_bytes", num_nvl_bytes, minimum[0]),
                               ("num_rdma_bytes", num_rdma_bytes - low_latency_bytes, minimum[1])):
        if given >= least:
            continue
        if name == "num_rdma_bytes" and low_latency_bytes:
            raise ArgumentError(with_rank(
                f"num_rdma_bytes={num_rdma_bytes} is below the {least + low_latency_bytes} bytes a Buffer serving "
                f"both modes across {nodes} NVLink nodes needs: normal mode's region first, at least {least} bytes "
                f"of control words (Buffer.get_rdma_size_hint(..., num_nvl_ranks={num_nvl_ranks}) for given "
                f"shapes), then low-latency mode's {low_latency_bytes} (Buffer.get_low_latency_size_hint(...)): "
                "give their sum"))
        raise ArgumentError(with_rank(
            f"{name}={given} is below the {least} bytes of control words every call across {nodes} NVLink "
            f"nodes needs; Buffer.get_normal_size_hint(..., num_nvl_ranks={num_nvl_ranks}) and "
            "get_rdma_size_hint(...) give sizes for given shapes"))


def check_internode_need(config: Config, num_ranks: int, num_nvl_ranks: int, hidden: int, num_topk: int,
                         num_experts: int, buffer_experts: int, sizes: tuple[int, int], what: str,
                         low_latency_bytes: int = 0) -> None:
    """An internode call's layout fits the Buffer's NVLink buffer and heap (sizes; of the heap, what low-latency
    mode's region after it leaves: ``low_latency_bytes``), and its experts the notify areas; every rank computes
    the same from the same sizes (a mismatch is notify's to report)."""
    cap = expert_cap(buffer_experts)
    if num_experts > cap:
        raise ArgumentError(with_rank(
            f"num_experts={num_experts} is more than this Buffer's notify areas hold ({cap}): make the Buffer with "
            f"num_experts={num_experts}"))
    need = config.internode_bytes(num_ranks, num_nvl_ranks, hidden, num_topk, cap)
    for name, label, have, want in zip(("num_nvl_bytes", "num_rdma_bytes"), ("NVLink buffer", "symmetric heap"),
                                       (sizes[0], sizes[1] - low_latency_bytes), need, strict=True):
        if want > have:
            given = f"{name}={have}" if name == "num_nvl_bytes" or not low_latency_bytes else (
                f"num_rdma_bytes={sizes[1]}, of which low-latency mode's region takes the last {low_latency_bytes}")
            raise ArgumentError(with_rank(
                f"this {what} needs {want} bytes of {label} (hidden={hidden}, top-{num_topk}, {config}) but the "
                f"Buffer has {given}: use Buffer.get_normal_size_hint / get_rdma_size_hint(..., "
                f"num_nvl_ranks={num_nvl_ranks})"))
