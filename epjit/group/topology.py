"""Where the ranks are and which GPU each uses: what every rank reports of itself (a :class:`RankInfo`), and the
decisions taken from all of them (nodes, NVLink nodes, a GPU per rank). The decisions are pure functions of what
every rank reported, so that every rank decides the same: all raise, or none does."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

# Where the kernel driver says it is loaded (a GPU machine, even when the CUDA runtime cannot use it).
DRIVER_FILE = "/proc/driver/nvidia/version"


@dataclass(frozen=True)
class RankInfo:
    host: str
    node_key: int | None
    local_rank: int
    local_size: int
    nvl_arg: Any  # num_nvl_ranks as passed (an int or None; otherwise its repr)
    bind_arg: Any  # bind_device as passed (True, False or None; otherwise its repr)
    gpus: int  # GPUs the CUDA runtime of this process sees (CUDA_VISIBLE_DEVICES applied)
    gpu_note: str | None  # why it sees none
    driver: bool  # an NVIDIA kernel driver is loaded on this host
    visible_devices: str | None  # CUDA_VISIBLE_DEVICES
    share_gpus: bool = False  # EPJIT_SHARE_GPUS (tests only): more local ranks than GPUs allowed


def visible_gpus() -> tuple[int, str | None]:
    """(count, why none) as this process's CUDA runtime sees them; cuda.bindings only, no CuPy import."""
    try:
        from cuda.bindings import runtime
    except ImportError as e:
        return 0, f"cuda-bindings is not importable ({e})"
    try:
        err, count = runtime.cudaGetDeviceCount()
    except (RuntimeError, OSError) as e:  # the driver library itself cannot be loaded
        return 0, f"no CUDA driver ({e})"
    if err == runtime.cudaError_t.cudaSuccess:
        return (int(count), None) if count else (0, "no CUDA device")
    if err == runtime.cudaError_t.cudaErrorNoDevice:  # e.g. CUDA_VISIBLE_DEVICES="" on a GPU machine
        return 0, "no CUDA device (cudaErrorNoDevice)"
    return 0, f"cudaGetDeviceCount: {getattr(err, 'name', err)}"


def number_nodes(infos: list[RankInfo]) -> tuple[list[int], list[str]]:
    """(node of each rank, host of each node): nodes are numbered in the order of their lowest rank."""
    first_on_host: dict[str, int] = {}
    for r, info in enumerate(infos):
        first_on_host.setdefault(info.host, r)
    keys = [info.node_key if info.node_key is not None else first_on_host[info.host] for info in infos]
    order = sorted(set(keys))
    index = {k: i for i, k in enumerate(order)}
    return [index[k] for k in keys], [infos[k].host for k in order]


def nvl_problem(num_nvl_ranks: int, node_of: list[int], local_size_of: list[int], host_of: list[str]) -> str | None:
    """Why num_nvl_ranks cannot work with this placement, or None."""
    size = len(node_of)
    if num_nvl_ranks < 1:
        return f"num_nvl_ranks must be >= 1, got {num_nvl_ranks}"
    for r in range(size):
        if local_size_of[r] < num_nvl_ranks:
            return (
                f"num_nvl_ranks={num_nvl_ranks} but host {host_of[r]} has only {local_size_of[r]} rank(s): "
                "an NVLink node cannot span hosts"
            )
    if size % num_nvl_ranks:
        return f"num_nvl_ranks={num_nvl_ranks} does not divide the {size} ranks into NVLink nodes"
    for first in range(0, size, num_nvl_ranks):
        last = first + num_nvl_ranks - 1
        nodes = sorted({node_of[r] for r in range(first, last + 1)})
        if len(nodes) > 1:
            hosts = sorted({host_of[r] for r in range(first, last + 1)})
            return (
                f"num_nvl_ranks={num_nvl_ranks}: NVLink node {first // num_nvl_ranks} (ranks {first}-{last}) spans "
                f"hosts {', '.join(hosts)}; place consecutive ranks on one host (e.g. mpirun --map-by slot)"
            )
    return None


def gpu_plan(infos: list[RankInfo], bind: bool | None, node_of: list[int]) -> tuple[list[int | None], str | None]:
    """The CUDA ordinal of every rank (None: no GPU), or why there cannot be one."""
    plan: list[int | None] = [None] * len(infos)
    if bind is False:
        return plan, None
    problems = []
    with_gpus, without = [], []
    for node in sorted(set(node_of)):
        ranks = [r for r in range(len(infos)) if node_of[r] == node]
        host = infos[ranks[0]].host
        counts = [infos[r].gpus for r in ranks]
        local = len(ranks)
        cvds = [infos[r].visible_devices for r in ranks]
        if max(counts) == 0:
            notes = "; ".join(sorted({infos[r].gpu_note or "no GPU" for r in ranks}))
            if bind is True:
                problems.append(f"bind_device=True but no GPU is visible on host {host} ({notes})")
            elif any(infos[r].driver for r in ranks) and "no CUDA device" not in notes:
                problems.append(
                    f"host {host} has an NVIDIA driver ({DRIVER_FILE}) but the CUDA runtime cannot use it "
                    f"({notes}): install the CUDA wheels that match the driver, or pass bind_device=False"
                )
            without.append(host)
            continue
        with_gpus.append(host)
        if min(counts) >= local:
            for r in ranks:
                plan[r] = infos[r].local_rank
        elif all(c == 1 for c in counts) and all(cvds) and len(set(cvds)) == local:
            # A wrapper gave each local rank its own GPU through CUDA_VISIBLE_DEVICES: each uses its ordinal 0.
            for r in ranks:
                plan[r] = 0
        elif all(infos[r].share_gpus for r in ranks):
            # Tests only: ranks share the GPUs round robin; their kernels are time-sliced (correctness, not speed).
            for r in ranks:
                plan[r] = infos[r].local_rank % min(counts)
        else:
            seen = f" (CUDA_VISIBLE_DEVICES={cvds[0]})" if cvds[0] is not None else ""
            problems.append(f"{local} local ranks but only {min(counts)} GPU(s) on host {host}{seen}")
    if not problems and with_gpus and without:
        problems.append(
            f"hosts {', '.join(with_gpus)} have GPUs but {', '.join(without)} none: every rank needs a GPU, "
            "or pass bind_device=False"
        )
    if problems:
        return [None] * len(infos), "; ".join(problems)
    return plan, None


def bind_gpu(ordinal: int) -> str | None:
    try:
        import cupy
    except ImportError as e:
        return f"CuPy is not importable ({e}): pip install 'epjit[cuda13]' (or [cuda12])"
    try:
        cupy.cuda.Device(ordinal).use()
    except RuntimeError as e:  # cupy's CUDARuntimeError
        return f"cannot use GPU {ordinal}: {e}"
    return None
