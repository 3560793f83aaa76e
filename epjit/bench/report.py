"""What a run reports: its rows (``Row``, the fields of ``--json``'s rows), the table they print as, one a case
and again by ``--summary``, and the JSON file ``--json`` writes."""

from __future__ import annotations

import json
import os
import socket
import sys
import time
from dataclasses import asdict, dataclass

# 16-byte stores from all SMs, all ranks to all peers at once, 4 x H200 (docs/performance.md: the ceilings)
PLAIN_STORE_CEILING_GBS = 345.0


@dataclass
class Row:
    """One case's figures: a line of the table, a row of ``--json``'s file (docs/benchmark.md: the columns)."""

    mode: str
    tokens: int
    hidden: int
    topk: int
    experts: int
    sms: int
    ranks: int
    epjit_us: float
    nccl_us: float | None
    out_gbs: float
    deepep_gbs: float
    nccl_out_gbs: float | None
    ratio: float | None  # NCCL time / epjit time
    pct_nvlink: float
    # Rows of runs before internode lack these (None).
    num_nvl_ranks: int | None = None  # ranks of one NVLink node in this run
    rdma_pairs: int | None = None  # (token, other node) pairs that crossed the RDMA leg, all ranks
    rdma_bytes: int | None = None  # their bytes on the wire, all ranks (put ceiling: bytes put by all ranks)
    rdma_gbs: float | None = None  # RDMA bytes leaving a rank / its time, slowest rank
    pct_put: float | None = None  # rdma_gbs against the best put ceiling of the same run
    # Rows of runs before --peers deepep lack these (None), as do rows DeepEP was not timed for.
    deepep_us: float | None = None  # DeepEP's median of the same call (slowest rank)
    deepep_ratio: float | None = None  # DeepEP time / epjit time: above 1, epjit is faster


def slowest(values: list[float | None]) -> float | None:
    """The slowest rank's figure, or None where some rank has none (a peer not timed)."""
    return None if not values or None in values else max(v for v in values if v is not None)


def with_deepep(row: Row, deepep_us: float | None, epjit_us: float) -> Row:
    """``row`` with DeepEP's time of the same call and its ratio to epjit's (None: not timed)."""
    if deepep_us:
        row.deepep_us, row.deepep_ratio = round(deepep_us, 1), round(deepep_us / epjit_us, 2)
    return row


_HEADER = (f"{'mode':<19} {'tokens':>6} {'hidden':>6} {'sms':>3} {'R':>2} {'epjit us':>9} {'out GB/s':>8} "
           f"{'DeepEP GB/s':>11} {'NCCL us':>8} {'NCCL GB/s':>9} {'NCCL/epjit':>10} {'DeepEP us':>9} "
           f"{'DeepEP/epjit':>12} {'% NVLink':>8} {'V':>2} {'RDMA pairs':>10} {'RDMA MB':>8} {'RDMA GB/s':>9} "
           f"{'% put':>6}")


def _cell(value: float | None, width: int, spec: str = ".1f") -> str:
    """A column that rows without it (None) leave as '-'."""
    return f"{'-':>{width}}" if value is None else f"{value:>{width}{spec}}"


def print_row(row: Row) -> None:
    """One row of the table, the header first the first time a process prints one."""
    if not getattr(print_row, "header", False):
        print(_HEADER)
        print_row.header = True  # type: ignore[attr-defined]
    rdma_mb = row.rdma_bytes / 1e6 if row.rdma_bytes is not None else None
    print(f"{row.mode:<19} {row.tokens:>6} {row.hidden:>6} {row.sms:>3} {row.ranks:>2} {row.epjit_us:>9.1f} "
          f"{row.out_gbs:>8.1f} {row.deepep_gbs:>11.1f} {row.nccl_us or float('nan'):>8.1f} "
          f"{row.nccl_out_gbs or float('nan'):>9.1f} {row.ratio or float('nan'):>10.2f} {_cell(row.deepep_us, 9)} "
          f"{_cell(row.deepep_ratio, 12, '.2f')} {row.pct_nvlink:>8.1f} {_cell(row.num_nvl_ranks, 2, 'd')} "
          f"{_cell(row.rdma_pairs, 10, 'd')} {_cell(rdma_mb, 8)} {_cell(row.rdma_gbs, 9)} {_cell(row.pct_put, 6)}",
          flush=True)


def load_rows(path: str) -> list[Row]:
    """The rows of a file ``--json`` wrote, of any version: fields it lacks are None, fields a later version added
    are dropped. Raises ValueError, naming the file, where it holds no rows."""
    fields = set(Row.__dataclass_fields__)
    try:
        with open(path) as f:
            rows = json.load(f)["rows"]
        return [Row(**{k: v for k, v in row.items() if k in fields}) for row in rows]
    except (OSError, ValueError) as e:
        raise ValueError(f"--summary {path}: {e}") from None
    except (KeyError, TypeError, AttributeError):
        raise ValueError(f"--summary {path}: no benchmark rows in it (a JSON object whose \"rows\" are objects with "
                         "every field of a row, as --json writes)") from None


def print_summary(paths: list[str]) -> None:
    """Every row of these files as one table. Raises ValueError before printing anything where one holds none."""
    for row in [row for path in paths for row in load_rows(path)]:
        print_row(row)


def write_json(path: str, rows: list[Row], start: float) -> None:
    """``{"meta": ..., "rows": [...]}``: the date, host, seconds since ``start``, the command line and the
    EPJIT_, NCCL_, DEEPEP_ and NVSHMEM_ environment, then the rows (docs/benchmark.md)."""
    env = {k: v for k, v in os.environ.items() if k.startswith(("EPJIT_", "NCCL_", "DEEPEP_", "NVSHMEM_"))}
    meta = {"date": time.strftime("%Y-%m-%d"), "host": socket.gethostname(), "seconds": time.time() - start,
            "argv": sys.argv, "env": env}
    with open(path, "w") as f:
        json.dump({"meta": meta, "rows": [asdict(r) for r in rows]}, f, indent=1)
