"""Every ``EPJIT_*`` setting, read in one place.

Settings that change generated code are returned by :func:`codegen_settings` and become part of the JIT cache key.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path


def _float(name: str, default: float) -> float:
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    try:
        value = float(raw)
    except ValueError:
        raise ValueError(f"{name}={raw!r} is not a number") from None
    if value <= 0:
        raise ValueError(f"{name}={raw!r} must be > 0")
    return value


def _optional_float(name: str) -> float | None:
    """Like :func:`_float`, but unset (or empty) means "no limit"."""
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return None
    return _float(name, 0.0)


@dataclass(frozen=True)
class Settings:
    cache_dir: Path
    timeout_s: float
    log: str
    arch: str | None
    poison_outputs: bool
    profile: bool
    collective_timeout_s: float | None = None
    ll_force_puts: bool = False
    one_node_nvshmem: bool = False
    rdma_by_stores: bool = False
    ll_num_sms: int = 0
    share_gpus: bool = False
    shrink_timeout_s: float | None = None


def settings() -> Settings:
    """Read the environment now (not at import), so tests and launchers may change it."""
    return Settings(
        # Where compiled cubins are kept: $EPJIT_CACHE_DIR/<epjit version>/<sm_XX>/<kernel>.<hash16>.cubin
        cache_dir=Path(os.environ.get("EPJIT_CACHE_DIR") or Path.home() / ".cache" / "epjit"),
        # How long any kernel spin-wait may poll before it records what it waited for and traps.
        timeout_s=_float("EPJIT_TIMEOUT_S", 100.0),
        # "info" (quiet) or "debug".
        log=os.environ.get("EPJIT_LOG", "info").lower(),
        # Compile for this arch instead of the current device's (e.g. "sm_90" on a machine with no GPU).
        arch=os.environ.get("EPJIT_ARCH") or None,
        # Debugging and tests: fill every output with garbage before a kernel writes it, so a row the kernel
        # forgets shows up instead of reading as the zeros a fresh allocation happened to hold.
        poison_outputs=os.environ.get("EPJIT_POISON_OUTPUTS", "0") not in ("", "0"),
        # Record where the time of each Buffer call goes (host phases and kernel events); Buffer.profile() reads it.
        profile=os.environ.get("EPJIT_PROFILE", "0") not in ("", "0"),
        # How long a host-side collective (allgather/bcast/barrier of epjit.Group) may wait for the other ranks
        # before it raises CollectiveError. Unset: wait for ever (ranks may legitimately wait minutes while one
        # of them compiles; the launcher or mpirun ends the job when a rank dies).
        collective_timeout_s=_optional_float("EPJIT_COLLECTIVE_TIMEOUT_S"),
        # Low-latency kernels: use NVSHMEM puts and signals even where NVLink gives a direct pointer (how the
        # put path, which a cluster without NVLink between nodes takes, is tested on one node).
        ll_force_puts=os.environ.get("EPJIT_LL_FORCE_PUTS", "0") not in ("", "0"),
        # Inside one NVLink node a Buffer's symmetric region (num_rdma_bytes: the low-latency buffers) is CUDA IPC
        # memory and NVSHMEM never starts; this keeps it on NVSHMEM's heap instead (to compare the two).
        one_node_nvshmem=os.environ.get("EPJIT_ONE_NODE_NVSHMEM", "0") not in ("", "0"),
        # Virtual nodes on one host (num_nvl_ranks below the ranks): the symmetric region on CUDA IPC memory every
        # rank maps and the internode kernels' RDMA leg as NVLink stores, so NVSHMEM never starts (for
        # compute-sanitizer, under which NVSHMEM does not start, and hosts without NVSHMEM). Refused across hosts.
        rdma_by_stores=os.environ.get("EPJIT_RDMA_BY_STORES", "0") not in ("", "0"),
        # Blocks (one per SM) of a low-latency kernel; 0: min(SMs, 128). For tuning sweeps.
        ll_num_sms=int(_float("EPJIT_LL_NUM_SMS", 0)),
        # Tests only: run more ranks on a host than it has GPUs, rank i on GPU local_rank % GPUs (4 ranks on a
        # 2-GPU machine). Ranks sharing a GPU are time-sliced by the driver: their results are correct, their
        # timings mean nothing.
        share_gpus=os.environ.get("EPJIT_SHARE_GPUS", "0") not in ("", "0"),
        # Shrink mode (a low-latency Buffer made with enable_shrink): how long a kernel waits for a peer before it
        # masks the peer and goes on without it. Unset: EPJIT_TIMEOUT_S.
        shrink_timeout_s=_optional_float("EPJIT_SHRINK_TIMEOUT_S"),
    )


def codegen_settings() -> dict[str, str]:
    """Settings that change a kernel binary (part of the cache key). None yet: the timeout is a runtime value."""
    return {}


# Variables of the launcher's own channel (set by ``python -m epjit.launch`` for each rank it starts).
LAUNCH_ADDR = "EPJIT_LAUNCH_ADDR"  # host:port of the launcher's rendezvous server
LAUNCH_TOKEN = "EPJIT_LAUNCH_TOKEN"  # secret shared by the launcher and its ranks
RANK = "EPJIT_RANK"
WORLD_SIZE = "EPJIT_WORLD_SIZE"
LOCAL_RANK = "EPJIT_LOCAL_RANK"
LOCAL_SIZE = "EPJIT_LOCAL_SIZE"
