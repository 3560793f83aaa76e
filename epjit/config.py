"""Config: how many SMs and how large the chunks of the normal-mode kernels are, and buffer size hints.

Pure Python (no GPU): the heuristics are unit-tested on the CPU.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .errors import ArgumentError, ArgumentTypeError, check_flag, check_int, with_rank
from .kernels.intranode import NUM_THREADS, IntranodeSpec, intranode_nvl_bytes, intranode_spec

MAX_CHANNELS = 128  # every Buffer reserves control words for this many channels

# At most this many reader warps of a combine block (one warp coordinates, the others read or send): a ring must
# hold a whole chunk beyond the rows those readers may be waiting on at once, or the sender could wait for room
# that never frees.
COMBINE_READERS = NUM_THREADS // 32 - 1


@dataclass(frozen=True)
class Config:
    """SMs (one block a channel: each sends, receives and copies its share) and chunk sizes in tokens.

    nvl_chunk_send: tokens a sender pushes between tail updates; nvl_chunk_recv: ring slots per (channel, rank).
    rdma_chunk_*: for the internode kernels (unused inside one NVLink node).

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


def _default_spec(num_ranks: int) -> IntranodeSpec:
    """The default warp roles for a rank count a caller gave (ArgumentError naming it where there are none)."""
    num_ranks = check_int(num_ranks, "num_ranks", 1)
    try:
        return intranode_spec(num_ranks)
    except ValueError as e:
        raise ArgumentError(with_rank(f"num_ranks={num_ranks}: {e}")) from None


def get_dispatch_config(num_ranks: int, spec: IntranodeSpec | None = None) -> Config:
    """Defaults for dispatch, by rank count (and the kernel's warp roles: ``spec``, default
    ``intranode_spec(num_ranks)``): 24 channels (one SM each), and chunks of four tokens a warp of a sending group
    between tail updates, at least 12. Each tail update is a system-scope release that stalls the group even with
    nothing outstanding, so a chunk must outweigh it (docs/history.md, "Rings and chunks"). 2 ranks: 10 warps a
    peer, chunks of 40; 4 ranks: 4 warps a peer, 16 (phased, 12 warps in one group: 48)."""
    spec = spec or _default_spec(num_ranks)
    return Config(24, max(12, 4 * spec.dispatch_group_send_warps), 256)


def get_combine_config(num_ranks: int, spec: IntranodeSpec | None = None) -> Config:
    """Defaults for combine, by rank count (and the kernel's sending warps: ``spec``): the same channels as dispatch
    (combine replays its channels), and chunks of about 12 rows, rounded up to a whole number of rows a sending
    warp: a combine reader waits for the chunk holding its token's row, so large chunks leave the readers a chunk
    behind the senders (dispatch's drains copy rows as they come and take larger chunks; docs/history.md, "Rings
    and chunks"). 2 ranks: 14 rows; 4 and 8 ranks: 12."""
    senders = max(1, (spec or _default_spec(num_ranks)).combine_send_warps)
    return Config(24, -(-12 // senders) * senders, 256)


def normal_size_hint(num_ranks: int, hidden: int, num_topk: int = 8, num_experts: int = 256,
                     config: Config | None = None) -> int:
    """num_nvl_bytes a Buffer needs for normal-mode dispatch (bf16 or FP8) and combine with these sizes (each
    config's nvl_bytes checks them)."""
    config_key(config)  # refuses anything but a Config, naming it
    configs = [config] if config is not None else [get_dispatch_config(num_ranks), get_combine_config(num_ranks)]
    return max(c.nvl_bytes(num_ranks, hidden, num_topk, num_experts, fp8) for c in configs for fp8 in (False, True))


def config_key(config: Any) -> Any:
    """``config`` as part of a plan's key: () for None. Anything but a Config is refused here, naming the argument
    (a dict would fail the plan lookup with a bare "unhashable" TypeError)."""
    if config is None:
        return ()
    if not isinstance(config, Config):
        raise ArgumentTypeError(with_rank(f"config must be an epjit.Config, got {type(config).__name__}"))
    return config
