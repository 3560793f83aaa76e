"""``python -m epjit.bench``: epjit beside NCCL's all_to_all_single and DeepEP, timed alike (docs/benchmark.md).

Its modules: ``cli`` (the command line, its checks and the run), ``protocol`` (the timing protocol: every rank
starting together, medians of CUDA-event spans, CUDA graphs of a call, the host's time of one), ``normal`` and
``low_latency`` (each mode's cases and rows), ``ceilings`` (the copy and put ceilings), ``peers`` (NCCL and DeepEP
making the same calls), ``report`` (the rows, their table, ``--json`` and ``--summary``), ``kernels`` (the
benchmark's own kernel specs) and ``variant`` (a kernel lab variant timed beside the built-in kernels). The names
below are what tests and tools use; a tool that times something as the benchmark does takes ``init_with_nccl``,
``start_together``, ``median_us``, ``graph_us`` (or ``graph``), ``hook_halves_us`` and ``host_us``.
"""

from __future__ import annotations

from .ceilings import put_mode_name, rail_peers
from .cli import main, requirements_problem, run, topology_problem
from .low_latency import LOW_LATENCY_MODES
from .normal import (
    NORMAL_MODES,
    base_mode,
    case_config,
    parse_roles,
    rdma_leg_bytes,
    rdma_message_bytes,
    rdma_pairs_out,
    tokens_per_node,
)
from .peers import PEERS
from .protocol import (
    current_cupy_stream,
    graph,
    graph_us,
    hook_halves_us,
    host_us,
    init_with_nccl,
    median_us,
    routing,
    start_together,
)
from .report import PLAIN_STORE_CEILING_GBS, Row, load_rows, print_summary

__all__ = [
    "LOW_LATENCY_MODES", "NORMAL_MODES", "PEERS", "PLAIN_STORE_CEILING_GBS", "Row", "base_mode", "case_config",
    "current_cupy_stream", "graph", "graph_us", "hook_halves_us", "host_us", "init_with_nccl", "load_rows", "main",
    "median_us", "parse_roles", "print_summary", "put_mode_name", "rail_peers", "rdma_leg_bytes",
    "rdma_message_bytes", "rdma_pairs_out", "requirements_problem", "routing", "run", "start_together",
    "tokens_per_node", "topology_problem",
]
