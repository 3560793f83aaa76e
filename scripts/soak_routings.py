"""Routing soak: many rounds of random routings through each mode, the whole run twice from the same seeds, every
round's outputs digested on the GPU and the two passes compared digest by digest, and every ``--check-every``-th
round of the first pass compared with epjit.reference. The GPU tier's cases are a few dozen fixed routings; a race that
corrupts one row in thousands of calls, or a result that depends on timing, needs many more, and different ones.

    python -m epjit.launch -n 2 scripts/soak_routings.py [--rounds 10000] [--modes normal,low_latency] [--seed S]
                                                          [--check-every 500] [--hidden 1024] [--json FILE]
    python -m epjit.launch -n 2 scripts/soak_routings.py --num-nvl-ranks 1 [--modes internode,low_latency] ...

Modes: ``normal`` (get_dispatch_layout, dispatch, combine inside one NVLink node), ``internode`` (the same across
NVLink nodes: the group made with ``--num-nvl-ranks V`` below the rank count, checked against the reference's
two-level combine; e.g. 2 ranks as 2 nodes of 1) and ``low_latency`` (low_latency_dispatch, low_latency_combine),
torch tensors, outputs poisoned (EPJIT_POISON_OUTPUTS=1: a row no kernel writes reads as NaN). The default modes are
normal and low_latency, or internode and low_latency with ``--num-nvl-ranks`` (a group spans nodes or not).

Round r of a mode draws what every rank must agree on (experts, top-k, the hole rate, a rank whose experts no token
names, FP8, alignment, bias, receive hooks) from a generator seeded by (seed, r, mode), and each rank its tokens,
routing and weights from one seeded by (seed, r, mode, rank): so any rank can rebuild any other rank's inputs for the
reference, and pass B repeats pass A exactly. Tokens a rank: 0 in 1 of 16 draws, the most in 1 of 16, else
log-uniform in 1..most (small batches are cheap and find other edges than big ones); the most is 4096 in normal mode
and 3072 in low-latency mode: a low-latency dispatch block stages every top-k entry of its tokens in shared memory,
sized for top-16, which 4096 tokens overflow (the Buffer refuses it). With more than 2 ranks low-latency mode takes
6144 / ranks tokens, so that a rank's receive arrays and the reference's copies of them stay the same size.

x (and an FP8 input's scales, and a bias) are made on the GPU from an integer hash of (salt, element) that the host
reproduces bit for bit (hash32 uses only operators numpy and torch share), so a round copies only its routing and
weights to the GPU, and the reference sees exactly what the kernels were given.

Outputs are digested where they lie: checksum reduces each tensor's bytes on the GPU to two position-dependent
64-bit sums (one flipped bit changes both), and a round copies only those to the host, 16 bytes an output, in one
copy; a low-latency round copies its recv_count and layout_range first (a few hundred bytes), from which the host
builds the index that gathers each expert's valid rows in canonical order on the GPU. Only the ``--check-every``
rounds copy whole outputs, for the bit-for-bit comparison with the reference. Copying every output of every round
and hashing it on the host took 21 ms a round in normal mode and 26 ms in low-latency mode at hidden 1024 (one H100,
2 ranks sharing it), too slow for 10,000 rounds.

Rank 0 prints a table and ``RESULT {json}``; every rank exits 1 when a round differs between the passes, a reference
check fails, or a low-latency layout_range does not tile its expert's rows.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import sys
import time
from dataclasses import dataclass, field
from typing import Any

import ml_dtypes
import numpy as np

import epjit
from epjit import reference

BF16 = np.dtype(ml_dtypes.bfloat16)
MODES = ("normal", "low_latency", "internode")
NORMAL_MODES = ("normal", "internode")  # the normal-mode kernels: inside one NVLink node, or across nodes
MASK32 = 0xFFFFFFFF
MAX_TOPK = 8
NORMAL_LOCAL_EXPERTS = (1, 2, 8, 16, 32)  # normal mode: experts a rank, drawn each round
LL_LOCAL_EXPERTS = 16  # low-latency mode: fixed by the Buffer
LL_ROWS_PER_EXPERT = 6144  # ranks x low-latency max tokens
HOLES = (0.0, 0.05, 0.2, 0.5, 1.0)  # share of top-k slots set to -1 (1.0: no token goes anywhere)
HOLES_P = (0.35, 0.25, 0.2, 0.15, 0.05)
# use_fp8, round_scale, use_ue8m0 of each low-latency precision, and how often a round draws it
PRECISIONS = {"bf16": (False, False, False), "fp8": (True, False, False), "fp8_round": (True, True, False),
              "fp8_ue8m0": (True, True, True)}
PRECISIONS_P = (0.4, 0.3, 0.15, 0.15)
PROGRESS_EVERY = 1000


# ---------------------------------------------------------------------------------------------------- rounds


@dataclass(frozen=True)
class Setup:
    """The sizes every round of a run shares."""

    ranks: int
    hidden: int
    normal_max_tokens: int = 4096
    ll_max_tokens: int = 3072
    ll_experts: int = 2 * LL_LOCAL_EXPERTS
    num_nvl_ranks: int = 1  # ranks a NVLink node in internode mode (below ranks)

    @staticmethod
    def for_ranks(ranks: int, hidden: int, num_nvl_ranks: int = 1) -> Setup:
        return Setup(ranks, hidden, ll_max_tokens=min(3072, LL_ROWS_PER_EXPERT // ranks),
                     ll_experts=LL_LOCAL_EXPERTS * ranks, num_nvl_ranks=num_nvl_ranks)

    def nodes(self, mode: str) -> int | None:
        """num_nvl_ranks as the reference takes it: V in internode mode, None (one node) otherwise."""
        return self.num_nvl_ranks if mode == "internode" else None


@dataclass(frozen=True, eq=False)
class RoundParams:
    """What every rank of a round agrees on (the kernels compare top-k, experts and FP8 across ranks)."""

    mode: str
    num_experts: int
    topk: int
    holes: float
    avoided: int  # a rank whose experts no token names, so it receives nothing; -1: none
    popularity: np.ndarray  # [E] weights of the experts in the draw: uneven loads
    max_tokens: int
    fp8: bool = False  # normal and internode modes: FP8 input
    alignment: int = 1  # normal mode: expert_alignment
    bias: bool = False  # normal mode: a bias in combine
    precision: str = "bf16"  # low-latency mode: a key of PRECISIONS
    dispatch_hook: bool = False  # low-latency mode: return_recv_hook, the hook run at once
    combine_hook: bool = False


@dataclass(frozen=True, eq=False)
class RankInputs:
    """One rank's inputs of a round: its routing and weights, and the salts of what the GPU generates."""

    topk_idx: np.ndarray  # [n, K] int64, -1 holes
    topk_weights: np.ndarray  # [n, K] float32
    salts: tuple[int, ...]  # x, FP8 scales, bias

    @property
    def num_tokens(self) -> int:
        return int(self.topk_idx.shape[0])


def _generator(seed: int, r: int, mode: str, stream: int) -> np.random.Generator:
    # stream 0: the round's shared draws; 1 + rank: that rank's
    return np.random.default_rng([seed, r, MODES.index(mode), stream])


def round_params(setup: Setup, seed: int, r: int, mode: str) -> RoundParams:
    rng = _generator(seed, r, mode, 0)
    ranks = setup.ranks
    if mode in NORMAL_MODES:
        num_experts, max_tokens = ranks * int(rng.choice(NORMAL_LOCAL_EXPERTS)), setup.normal_max_tokens
    else:
        num_experts, max_tokens = setup.ll_experts, setup.ll_max_tokens
    avoided = int(rng.integers(ranks)) if ranks > 1 and rng.random() < 1 / 8 else -1
    allowed = num_experts - (num_experts // ranks if avoided >= 0 else 0)
    topk = int(rng.integers(1, min(MAX_TOPK, allowed) + 1))
    holes = float(rng.choice(HOLES, p=HOLES_P))
    # half the rounds uniform, half with a few hot experts (gamma weights with a small shape are very uneven)
    popularity = rng.gamma(0.3, size=num_experts) + 1e-3 if rng.random() < 0.5 else np.ones(num_experts)
    common = dict(mode=mode, num_experts=num_experts, topk=topk, holes=holes, avoided=avoided,
                  popularity=popularity, max_tokens=max_tokens)
    if mode in NORMAL_MODES:
        return RoundParams(**common, fp8=bool(rng.random() < 0.25), alignment=int(rng.choice((1, 1, 1, 4, 128))),
                           bias=bool(rng.random() < 0.25))
    return RoundParams(**common, precision=str(rng.choice(list(PRECISIONS), p=PRECISIONS_P)),
                       dispatch_hook=bool(rng.random() < 1 / 3), combine_hook=bool(rng.random() < 1 / 3))


def token_count(rng: np.random.Generator, most: int) -> int:
    u = rng.random()
    if u < 1 / 16:
        return 0
    if u < 2 / 16:
        return most
    return min(most, max(1, int(math.exp(rng.random() * math.log(most)))))


def rank_inputs(setup: Setup, params: RoundParams, seed: int, r: int, rank: int) -> RankInputs:
    rng = _generator(seed, r, params.mode, 1 + rank)
    n, k = token_count(rng, params.max_tokens), params.topk
    experts = np.arange(params.num_experts)
    if params.avoided >= 0:
        experts = experts[experts // (params.num_experts // setup.ranks) != params.avoided]
    # k distinct experts a token, drawn by weight without replacement: the k largest log(u) / weight
    keys = np.log(1.0 - rng.random((n, len(experts)))) / params.popularity[experts]
    if k < len(experts):
        chosen = np.argpartition(-keys, k - 1, axis=1)[:, :k]
    else:
        chosen = np.argsort(-keys, axis=1)
    idx = experts[chosen].astype(np.int64)
    idx[rng.random((n, k)) < params.holes] = -1
    weights = rng.random((n, k), dtype=np.float32)
    salts = tuple(int(s) for s in rng.integers(0, 2**32, size=3))
    return RankInputs(np.ascontiguousarray(idx), weights, salts)


def all_inputs(setup: Setup, params: RoundParams, seed: int, r: int) -> list[RankInputs]:
    return [rank_inputs(setup, params, seed, r, s) for s in range(setup.ranks)]


# ---------------------------------------------------------------------------------------------------- generated data
# Operators only, on int64 arrays of numpy or torch, every value kept below 2**63 (a 32-bit value times a constant
# below 2**31): both frameworks compute the same bits, so the host rebuilds what the GPU made.


def hash32(index: Any, salt: int) -> Any:
    """A 32-bit hash of each element of ``index`` (non-negative int64) and ``salt`` (below 2**32)."""
    v = (index ^ salt) & MASK32
    v = v ^ (v >> 16)
    v = (v * 0x7FEB352D) & MASK32
    v = v ^ (v >> 15)
    v = (v * 0x2C1B3C6D) & MASK32
    return v ^ (v >> 16)


def bf16_bits(h: Any) -> Any:
    """bf16 bits: a sign, an exponent of 124..131 (|x| in [1/8, 64)), 7 mantissa bits: finite, never zero."""
    return ((h >> 16) & 0x8000) | ((124 + ((h >> 7) & 7)) << 7) | (h & 0x7F)


def fp8_bits(h: Any) -> Any:
    """e4m3 bytes other than its NaNs (0x7F, 0xFF)."""
    return ((h >> 8) & 0x80) | ((h & 0x7F) % 127)


def scale_bits(h: Any) -> Any:
    """float32 bits of a positive normal number in [2**-9, 2**-1)."""
    return ((118 + (h & 7)) << 23) | ((h >> 9) & 0x7FFFFF)


def signed16(bits: Any) -> Any:
    """16 bits as the int16 value with those bits (torch converts int64 to int16 exactly only in range)."""
    return bits - ((bits >> 15) << 16)


def host_x(inputs: RankInputs, hidden: int, fp8: bool) -> tuple[np.ndarray, np.ndarray | None]:
    """What the GPU's device_x makes: bf16 [n, H], or e4m3 bits [n, H] (uint8) and float32 scales [n, H/128]."""
    n = inputs.num_tokens
    index = np.arange(n * hidden, dtype=np.int64).reshape(n, hidden)
    if not fp8:
        return bf16_bits(hash32(index, inputs.salts[0])).astype(np.uint16).view(BF16), None
    blocks = np.arange(n * hidden // 128, dtype=np.int64).reshape(n, hidden // 128)
    return (fp8_bits(hash32(index, inputs.salts[0])).astype(np.uint8),
            scale_bits(hash32(blocks, inputs.salts[1])).astype(np.uint32).view(np.float32))


def host_bias(inputs: RankInputs, hidden: int) -> np.ndarray:
    n = inputs.num_tokens
    index = np.arange(n * hidden, dtype=np.int64).reshape(n, hidden)
    return bf16_bits(hash32(index, inputs.salts[2])).astype(np.uint16).view(BF16)


# ---------------------------------------------------------------------------------------------------- the experts
# What the soak's "experts" do to the rows they receive: a power of two a rank (normal) or an expert (low latency),
# exact in float32 and bf16, so a row sent back to the wrong token, slot or expert changes the sum.


def normal_factor(rank: int) -> float:
    return 2.0 ** (rank % 3 - 1)


def ll_factors(rank: int, num_local: int) -> np.ndarray:
    experts = rank * num_local + np.arange(num_local)
    return np.ldexp(np.float32(1), (experts % 4) - 2).astype(np.float32)


def normal_y_host(d: reference.DispatchResult, rank: int) -> np.ndarray:
    base = reference.fp8_to_float(d.x, d.x_scales) if d.x_scales is not None else d.x.astype(np.float32)
    return (base * np.float32(normal_factor(rank))).astype(BF16)


def ll_y_host(d: reference.LowLatencyDispatchResult, rank: int, num_local: int) -> np.ndarray:
    base = reference.fp8_to_float(d.x, d.x_scales) if d.x_scales is not None else d.x.astype(np.float32)
    return (base * ll_factors(rank, num_local)[:, None, None]).astype(BF16)


# ---------------------------------------------------------------------------------------------------- the reference


def expected_normal(setup: Setup, params: RoundParams, inputs: list[RankInputs], rank: int) -> dict[str, np.ndarray]:
    """What ``rank``'s normal or internode round must give, named as normal_round names its outputs (across nodes
    the layout's tokens a node too, and the combine summed node by node)."""
    num_experts, nodes = params.num_experts, setup.nodes(params.mode)
    sent = [host_x(i, setup.hidden, params.fp8) for i in inputs]
    idxs, ws = [i.topk_idx for i in inputs], [i.topk_weights for i in inputs]
    layout = reference.get_dispatch_layout(idxs[rank], num_experts, setup.ranks, nodes)
    ref = reference.dispatch([x for x, _ in sent], idxs, ws, num_experts,
                             x_scales=[s for _, s in sent] if params.fp8 else None,
                             expert_alignment=params.alignment)
    ys = [normal_y_host(ref[s], s) for s in range(setup.ranks)]
    biases = [host_bias(i, setup.hidden) for i in inputs] if params.bias else None
    combined = reference.combine(ys, [d.handle for d in ref], topk_weights=[d.topk_weights for d in ref],
                                 bias=biases, num_nvl_ranks=nodes)[rank]
    return normal_outputs(layout, ref[rank], combined, params.fp8)


def normal_outputs(layout: Any, dispatched: Any, combined: Any, fp8: bool) -> dict[str, Any]:
    """A normal round's outputs by name, from the reference's results or the Buffer's (the same attributes)."""
    out = {"num_tokens_per_rank": layout.num_tokens_per_rank, "num_tokens_per_expert": layout.num_tokens_per_expert,
           "is_token_in_rank": layout.is_token_in_rank, "x": dispatched.x, "topk_idx": dispatched.topk_idx,
           "topk_weights": dispatched.topk_weights,
           "num_recv_tokens_per_expert": np.asarray(dispatched.num_recv_tokens_per_expert, dtype=np.int64),
           "combined_x": combined.x, "combined_topk_weights": combined.topk_weights}
    if fp8:
        out["x_scales"] = dispatched.x_scales
    if layout.num_tokens_per_rdma_rank is not None:  # across nodes
        out["num_tokens_per_rdma_rank"] = layout.num_tokens_per_rdma_rank
    return out


def expected_low_latency(setup: Setup, params: RoundParams, inputs: list[RankInputs],
                         rank: int) -> dict[str, np.ndarray]:
    """What ``rank``'s low-latency round must give, in low_latency_outputs' form (the reference's order)."""
    use_fp8, round_scale, use_ue8m0 = PRECISIONS[params.precision]
    num_local = params.num_experts // setup.ranks
    xs = [host_x(i, setup.hidden, False)[0] for i in inputs]
    idxs, ws = [i.topk_idx for i in inputs], [i.topk_weights for i in inputs]
    want = reference.low_latency_dispatch(xs, idxs, setup.ll_max_tokens, params.num_experts, use_fp8=use_fp8,
                                          round_scale=round_scale, use_ue8m0=use_ue8m0)
    ys = [ll_y_host(want[s], s, num_local) for s in range(setup.ranks)]
    combined = reference.low_latency_combine(ys, idxs, ws, [w.handle for w in want])[rank].x
    mine = want[rank]
    valid = np.arange(mine.src_info.shape[1])[None, :] < mine.recv_count[:, None]
    out = {"recv_count": mine.recv_count, "block_counts": reference.unpack_layout_range(mine.layout_range)[1],
           "src_info": mine.src_info[valid], "x": mine.x[valid], "combined_x": combined}
    if use_fp8:
        out["x_scales"] = mine.x_scales[valid]
    return out


EXPECTED = {"normal": expected_normal, "internode": expected_normal, "low_latency": expected_low_latency}


def canonical_order(recv_count: np.ndarray, layout_range: np.ndarray, rows: int) -> tuple[np.ndarray, str | None]:
    """Where a low-latency round's received rows lie in its [L, rows, ...] arrays flattened to [L * rows, ...], in
    canonical order: expert by expert, each expert's source blocks in rank order.

    The API leaves the order of the source blocks inside an expert's rows open (only layout_range says where each
    is), so the digests and the reference see them in rank order. Built on the host from recv_count [L] and
    layout_range [L, R] (a few hundred bytes): the GPU then gathers every array's rows with one index. Returns the
    int64 indices and what is wrong where a recv_count is not in 0..rows or the blocks do not tile each expert's
    recv_count rows exactly; then the indices are each expert's first recv_count rows (clamped to 0..rows) in the
    order received, so that the round still has digests and the gather stays in bounds."""
    recv = recv_count.astype(np.int64)
    begins, counts = reference.unpack_layout_range(layout_range)
    problem = None
    outside = np.flatnonzero((recv < 0) | (recv > rows))
    if len(outside):
        e = int(outside[0])
        problem = f"expert {e}: recv_count {recv[e]} is not in 0..{rows}"
    else:
        # an empty block's begin says nothing: the non-empty blocks sorted by begin, the empty ones last
        by_begin = np.argsort(np.where(counts > 0, begins, np.iinfo(np.int64).max), axis=1, kind="stable")
        first, sizes = np.take_along_axis(begins, by_begin, 1), np.take_along_axis(counts, by_begin, 1)
        # tiled: each non-empty block begins where the ones before it end (the first at 0), and together they are
        # recv_count rows; then every index below is in its expert's first recv_count rows
        ends = np.cumsum(sizes, axis=1)
        tiled = np.all((first == ends - sizes) | (sizes == 0), axis=1) & (ends[:, -1] == recv)
        bad = np.flatnonzero(~tiled)
        if len(bad):
            e = int(bad[0])
            blocks = np.stack([begins[e], counts[e]], axis=1).tolist()
            problem = f"expert {e}: layout_range blocks (begin, count) {blocks} do not tile its {recv[e]} rows"
    expert_rows = np.arange(len(recv), dtype=np.int64) * rows
    if problem:
        starts, lengths = expert_rows, np.clip(recv, 0, rows)
    else:  # the blocks in (expert, source rank) order
        starts, lengths = (expert_rows[:, None] + begins).ravel(), counts.ravel()
    # a block's rows: its start plus each row's place in the output less the block's first place there
    before = np.cumsum(lengths) - lengths
    return np.repeat(starts - before, lengths) + np.arange(int(lengths.sum()), dtype=np.int64), problem


# ---------------------------------------------------------------------------------------------------- digests, checks
# Two odd 64-bit constants (the golden ratio's and splitmix64's), written as the int64 values with their bits: torch
# takes no Python int of 2**63 or more as an int64 scalar.
CHECK_K1 = 0x9E3779B97F4A7C15 - (1 << 64)
CHECK_K2 = 0xBF58476D1CE4E5B9 - (1 << 64)


def checksum(t: Any) -> Any:
    """int64 [2] on ``t``'s device: two position-dependent sums of ``t``'s raw bytes, mod 2**64, in torch ops.

    The bytes are read as int32 words (one by one where their count is not a multiple of 4), each word w_i widened
    to int64 (sign- or zero-extended: distinct bits stay distinct values). s1 = sum of w_i * m_i with
    m_i = (2i + 1) * K1: m_i is odd, so w -> w * m_i is a bijection mod 2**64 and a change in one word (one flipped
    bit anywhere) changes its term, and so the sum; m_i differs at every i (K1 is odd too), so words that trade
    places change it as well. s2 = sum of w_i ^ (m_i * K2): x -> x ^ c is a bijection too, so one changed word
    changes s2, and s2 is not linear in the words, so changes that cancel in s1 are unlikely to cancel in s2.
    torch's int64 arithmetic wraps, so both sums are exact mod 2**64 in whatever order the device adds: the same
    bytes give the same sums on any run. dtype and shape are mixed in by digests, on the host."""
    import torch

    if t.numel() == 0:  # the sums of no words; torch refuses the byte view where an empty tensor has stride 0
        return torch.zeros(2, dtype=torch.int64, device=t.device)
    raw = t.contiguous().view(torch.uint8).reshape(-1)
    wide = raw.numel() % 4 == 0
    if wide and raw.storage_offset() % 4:  # a view that starts inside a word cannot be read as int32 in place
        raw = raw.clone()
    words = (raw.view(torch.int32) if wide else raw).to(torch.int64)
    m = torch.arange(1, 2 * words.numel() + 1, 2, dtype=torch.int64, device=words.device).mul_(CHECK_K1)
    s1 = (words * m).sum()
    s2 = (words ^ m.mul_(CHECK_K2)).sum()
    return torch.stack([s1, s2])


def digests(outputs: dict[str, Any]) -> dict[str, bytes]:
    """A 16-byte digest of each output: its dtype, shape and bytes.

    Tensors are summed where they are (checksum: a few small kernels each) and their sums come to the host in one
    copy of 16 bytes an output, not their bytes (copying every output to the host and hashing it there took most of
    a round's time); numpy arrays, which are already on the host and small (counts), are hashed here."""
    names = sorted(outputs)
    on_device = [name for name in names if not isinstance(outputs[name], np.ndarray)]
    sums: dict[str, np.ndarray] = {}
    if on_device:
        import torch

        stacked = torch.stack([checksum(outputs[name]) for name in on_device]).cpu().numpy()  # the round's copy
        sums = dict(zip(on_device, stacked, strict=True))
    found = {}
    for name in names:
        a = outputs[name]
        kind = a.dtype.name if isinstance(a, np.ndarray) else str(a.dtype)
        h = hashlib.blake2b(f"{kind}{tuple(a.shape)}".encode(), digest_size=16)
        if name in sums:
            h.update(sums[name].tobytes())
        else:
            h.update(memoryview(np.ascontiguousarray(a).reshape(-1).view(np.uint8)))
        found[name] = h.digest()
    return found


def difference(name: str, got: np.ndarray, want: np.ndarray) -> str | None:
    """None where ``got`` has ``want``'s dtype, shape and bits; else what differs, and where first."""
    if got.dtype != want.dtype or got.shape != want.shape:
        return f"{name}: {got.dtype}{list(got.shape)} != reference {want.dtype}{list(want.shape)}"
    g, w = np.ascontiguousarray(got), np.ascontiguousarray(want)
    unsigned = f"u{g.dtype.itemsize}"
    bad = np.argwhere(g.view(unsigned) != w.view(unsigned))
    if not len(bad):
        return None
    first = tuple(bad[0])
    return (f"{name}: {len(bad)} of {g.size} elements differ, first at {bad[:3].tolist()}: got {g[first]!r} "
            f"want {w[first]!r}")


def compare(got: dict[str, np.ndarray], want: dict[str, np.ndarray]) -> list[str]:
    problems = []
    for name in sorted(set(got) | set(want)):
        if name not in got or name not in want:
            problems.append(f"{name}: only in {'the outputs' if name in got else 'the reference'}")
            continue
        found = difference(name, got[name], want[name])
        if found:
            problems.append(found)
    return problems


# ---------------------------------------------------------------------------------------------------- on the GPU


def _device(a: np.ndarray) -> Any:
    import torch

    return torch.from_numpy(np.ascontiguousarray(a)).cuda()


def _as_ints(t: Any) -> Any:
    """``t`` viewed as integers of its element size where torch or numpy lack its dtype (bf16, FP8): the same bits."""
    import torch

    if t.dtype == torch.bfloat16:
        return t.view(torch.int16)
    if t.dtype == torch.float8_e4m3fn:
        return t.view(torch.uint8)
    return t


def _host(t: Any) -> np.ndarray:
    """A copy of ``t`` on the host: bf16 as ml_dtypes' bf16, FP8 as its bytes (what epjit.reference gives)."""
    a = _as_ints(t).cpu().numpy()
    return a.view(BF16) if str(t.dtype) == "torch.bfloat16" else a


def host_outputs(outputs: dict[str, Any]) -> dict[str, np.ndarray]:
    """A round's outputs copied to the host, for the reference check (the check rounds only: copying is slow)."""
    return {name: a if isinstance(a, np.ndarray) else _host(a) for name, a in outputs.items()}


def device_x(inputs: RankInputs, hidden: int, fp8: bool) -> Any:
    """host_x's values, made on this GPU: a bf16 tensor, or an (FP8, scales) pair."""
    import torch

    n = inputs.num_tokens
    index = torch.arange(n * hidden, dtype=torch.int64, device="cuda").view(n, hidden)
    if not fp8:
        return signed16(bf16_bits(hash32(index, inputs.salts[0]))).to(torch.int16).view(torch.bfloat16)
    blocks = torch.arange(n * hidden // 128, dtype=torch.int64, device="cuda").view(n, hidden // 128)
    return (fp8_bits(hash32(index, inputs.salts[0])).to(torch.uint8).view(torch.float8_e4m3fn),
            scale_bits(hash32(blocks, inputs.salts[1])).to(torch.int32).view(torch.float32))


def device_bias(inputs: RankInputs, hidden: int) -> Any:
    import torch

    n = inputs.num_tokens
    index = torch.arange(n * hidden, dtype=torch.int64, device="cuda").view(n, hidden)
    return signed16(bf16_bits(hash32(index, inputs.salts[2]))).to(torch.int16).view(torch.bfloat16)


def dequantised(x: Any, scales: Any) -> Any:
    """float32 of received rows [..., H]: bf16 widened, or e4m3 times its block's scale (float32 or e8m0 byte), one
    float32 multiply as reference.fp8_to_float does."""
    import torch

    if scales is None:
        return x.float()
    if scales.dtype == torch.uint8:  # the exponent byte: 2**(byte - 127) is the float32 with those exponent bits
        scales = (scales.to(torch.int32) << 23).view(torch.float32)
    shape = x.shape
    return (x.float().view(*shape[:-1], shape[-1] // 128, 128) * scales.unsqueeze(-1)).view(shape)


def normal_round(ctx: Context, params: RoundParams, inputs: RankInputs) -> tuple[dict[str, Any], str | None]:
    import torch

    buf, hidden = ctx.buffers[params.mode], ctx.setup.hidden
    idx, w = _device(inputs.topk_idx), _device(inputs.topk_weights)
    layout = buf.get_dispatch_layout(idx, params.num_experts)
    d = buf.dispatch(device_x(inputs, hidden, params.fp8), topk_idx=idx, topk_weights=w, layout=layout,
                     expert_alignment=params.alignment)
    y = (dequantised(d.x, d.x_scales) * normal_factor(ctx.rank)).to(torch.bfloat16)
    c = buf.combine(y, d.handle, topk_weights=d.topk_weights,
                    bias=device_bias(inputs, hidden) if params.bias else None)
    # left on the GPU (digests sums them there); the counts are on the host already
    return normal_outputs(layout, d, c, params.fp8), None


def low_latency_round(ctx: Context, params: RoundParams, inputs: RankInputs) -> tuple[dict[str, Any], str | None]:
    import torch

    buf, setup = ctx.buffers["low_latency"], ctx.setup
    use_fp8, round_scale, use_ue8m0 = PRECISIONS[params.precision]
    num_local = params.num_experts // setup.ranks
    idx, w = _device(inputs.topk_idx), _device(inputs.topk_weights)
    d = buf.low_latency_dispatch(device_x(inputs, setup.hidden, False), idx, setup.ll_max_tokens,
                                 params.num_experts, use_fp8=use_fp8, round_scale=round_scale, use_ue8m0=use_ue8m0,
                                 return_recv_hook=params.dispatch_hook)
    if params.dispatch_hook:
        d.hook()
    factors = _device(ll_factors(ctx.rank, num_local)).view(-1, 1, 1)
    y = dequantised(d.x, d.x_scales).mul_(factors).to(torch.bfloat16)
    c = buf.low_latency_combine(y, idx, w, d.handle, return_recv_hook=params.combine_hook)
    if params.combine_hook:
        c.hook()
    arrays = {"src_info": d.handle.src_info, "x": d.x}
    if use_fp8:
        arrays["x_scales"] = d.x_scales
    return low_latency_outputs(d.recv_count, d.handle.layout_range, arrays, c.x)


def low_latency_outputs(recv_count: Any, layout_range: Any, arrays: dict[str, Any],
                        combined_x: Any) -> tuple[dict[str, Any], str | None]:
    """A low-latency round's outputs in canonical_order: recv_count and block_counts on the host, the valid rows of
    each [L, rows, ...] tensor of ``arrays`` (src_info, x, x_scales) gathered on its device, each expert's source
    blocks in rank order, and combined_x as it is. Returns them and what is wrong with the layout, if anything."""
    import torch

    num_local = recv_count.shape[0]
    # one small copy (recv_count and layout_range, a few hundred bytes) from which the host builds the gather index
    small = torch.cat([recv_count.to(torch.int64), layout_range.reshape(-1)]).cpu().numpy()
    # recv_count back in its own dtype (int32), which the reference check compares
    recv = small[:num_local].astype(str(recv_count.dtype).removeprefix("torch."))
    packed = small[num_local:].reshape(num_local, -1)
    order, problem = canonical_order(recv, packed, arrays["src_info"].shape[1])
    index = torch.from_numpy(order).to(combined_x.device)
    out = {"recv_count": recv, "block_counts": reference.unpack_layout_range(packed)[1], "combined_x": combined_x}
    for name, t in arrays.items():
        out[name] = _as_ints(t).flatten(0, 1).index_select(0, index).view(t.dtype)
    return out, problem


ROUNDS = {"normal": normal_round, "internode": normal_round, "low_latency": low_latency_round}


def make_buffers(group: epjit.Group, setup: Setup, modes: list[str]) -> dict[str, epjit.Buffer]:
    buffers = {}
    for mode in set(modes) & set(NORMAL_MODES):  # sized for the largest top-k and expert count a round draws
        sizes = (setup.ranks, setup.hidden, MAX_TOPK, setup.ranks * max(NORMAL_LOCAL_EXPERTS))
        nodes = setup.nodes(mode)
        buffers[mode] = epjit.Buffer(group, num_nvl_bytes=epjit.Buffer.get_normal_size_hint(*sizes,
                                                                                            num_nvl_ranks=nodes),
                                     num_rdma_bytes=epjit.Buffer.get_rdma_size_hint(*sizes, num_nvl_ranks=nodes))
    if "low_latency" in modes:  # num_rdma_bytes=0: the size hint of these sizes
        buffers["low_latency"] = epjit.Buffer(group, low_latency_mode=True,
                                              num_max_dispatch_tokens_per_rank=setup.ll_max_tokens,
                                              hidden=setup.hidden, num_experts=setup.ll_experts)
    return buffers


# ---------------------------------------------------------------------------------------------------- the run


@dataclass
class ModeRun:
    """One mode's record on this rank."""

    seconds: list[float] = field(default_factory=list)  # pass A (with the reference checks), pass B
    digests: list[dict[str, bytes]] = field(default_factory=list)  # pass A's, a round each
    mismatched: dict[int, list[str]] = field(default_factory=dict)  # round -> outputs whose bits pass B changed
    checks: int = 0
    failed: dict[int, list[str]] = field(default_factory=dict)  # round -> how it differs from the reference
    invalid: dict[int, str] = field(default_factory=dict)  # round -> a low-latency layout that does not tile

    def summary(self) -> dict[str, Any]:
        return {"seconds": self.seconds, "mismatched": self.mismatched, "checks": self.checks,
                "failed": {r: p[:3] for r, p in self.failed.items()}, "invalid": self.invalid}


@dataclass
class Context:
    setup: Setup
    seed: int
    rounds: int
    check_every: int
    rank: int
    buffers: dict[str, Any]
    runs: dict[str, ModeRun]


def run_pass(ctx: Context, mode: str, first: bool) -> None:
    """Every round of ``mode`` once: pass A (``first``) keeps the digests and checks against the reference, pass B
    compares its digests with pass A's."""
    run, started = ctx.runs[mode], time.perf_counter()
    for r in range(ctx.rounds):
        params = round_params(ctx.setup, ctx.seed, r, mode)
        inputs = rank_inputs(ctx.setup, params, ctx.seed, r, ctx.rank)
        outputs, problem = ROUNDS[mode](ctx, params, inputs)
        if problem:
            run.invalid[r] = problem
        found = digests(outputs)  # summed on the GPU: one small copy a round
        if first:
            run.digests.append(found)
        else:
            before = run.digests[r]
            differ = sorted(n for n in set(found) | set(before) if found.get(n) != before.get(n))
            if differ:
                run.mismatched[r] = differ
        if first and ctx.check_every > 0 and r % ctx.check_every == 0:
            run.checks += 1
            # every rank's inputs, rebuilt from their seeds: the reference needs them all
            want = EXPECTED[mode](ctx.setup, params, all_inputs(ctx.setup, params, ctx.seed, r), ctx.rank)
            problems = compare(host_outputs(outputs), want)
            if problems:
                run.failed[r] = problems
        if ctx.rank == 0 and (r + 1) % PROGRESS_EVERY == 0:
            print(f"pass {'A' if first else 'B'} {mode}: {r + 1}/{ctx.rounds} rounds, "
                  f"{time.perf_counter() - started:.1f} s", flush=True)
    run.seconds.append(time.perf_counter() - started)


def merge(rounds: int, per_rank: list[dict[str, Any]]) -> dict[str, Any]:
    """One mode's figures over every rank: a round counts once however many ranks saw it go wrong."""

    def rounds_of(key: str) -> list[int]:
        return sorted({int(r) for summary in per_rank for r in summary[key]})

    def first(key: str) -> list[str]:
        return [f"round {r} rank {rank}: {summary[key][r]}" for rank, summary in enumerate(per_rank)
                for r in sorted(summary[key])][:10]

    seconds = [max(s["seconds"][i] for s in per_rank) for i in range(2)]
    return {"rounds": rounds, "seconds": [round(s, 2) for s in seconds],
            "ms_per_round": round(1e3 * seconds[1] / rounds, 3), "mismatched": len(rounds_of("mismatched")),
            "checks": min(s["checks"] for s in per_rank), "failed": len(rounds_of("failed")),
            "invalid": len(rounds_of("invalid")), "first_mismatches": first("mismatched"),
            "first_failures": first("failed"), "first_invalid": first("invalid")}


def table(modes: dict[str, dict[str, Any]]) -> str:
    lines = [f"{'mode':<12}{'rounds':>8}{'pass A s':>10}{'pass B s':>10}{'ms/round':>10}{'mismatched':>12}"
             f"{'checks':>8}{'failed':>8}{'invalid':>9}"]
    for mode, m in modes.items():
        lines.append(f"{mode:<12}{m['rounds']:>8}{m['seconds'][0]:>10}{m['seconds'][1]:>10}{m['ms_per_round']:>10}"
                     f"{m['mismatched']:>12}{m['checks']:>8}{m['failed']:>8}{m['invalid']:>9}")
    for m in modes.values():
        lines += m["first_mismatches"] + m["first_failures"] + m["first_invalid"]
    return "\n".join(lines)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=10_000)
    parser.add_argument("--modes", help="default: normal,low_latency, or internode,low_latency with --num-nvl-ranks")
    parser.add_argument("--num-nvl-ranks", type=int, help="ranks a NVLink node, below the rank count: the group spans "
                                                          "nodes (internode mode); default: the ranks a host")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--check-every", type=int, default=500, help="compare round r with epjit.reference when r is "
                                                                      "a multiple of this (pass A; 0: never)")
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--json", help="write the figures of every rank here (rank 0)")
    args = parser.parse_args()
    normal = "normal" if args.num_nvl_ranks is None else "internode"
    args.modes = list(dict.fromkeys(args.modes.split(","))) if args.modes else [normal, "low_latency"]
    wrong = [m for m in args.modes if m not in MODES or m in set(NORMAL_MODES) - {normal}]
    if wrong:
        parser.error(f"modes {wrong} cannot run {'with' if args.num_nvl_ranks is not None else 'without'} "
                     f"--num-nvl-ranks; these "
                     f"can: {normal}, low_latency")
    if args.rounds < 1 or args.seed < 0 or args.check_every < 0:
        parser.error("--rounds must be >= 1, --seed and --check-every >= 0")
    if args.hidden < 128 or args.hidden % 128:
        parser.error(f"--hidden {args.hidden}: a positive multiple of 128 (the FP8 rounds need it)")
    return args


def main() -> int:
    args = parse_args()
    os.environ["EPJIT_POISON_OUTPUTS"] = "1"  # read when a Buffer is made: a row no kernel writes reads as NaN
    import torch

    group = epjit.init(num_nvl_ranks=args.num_nvl_ranks)
    torch.cuda.set_device(group.device)
    several = group.num_nvl_ranks < group.size  # (without --num-nvl-ranks too, where the ranks span hosts)
    if ("internode" in args.modes and not several) or ("normal" in args.modes and several):
        raise SystemExit(f"{group.size} ranks in nodes of {group.num_nvl_ranks}: "
                         + ("internode mode needs fewer ranks a node than ranks (--num-nvl-ranks)" if not several
                            else "the group spans nodes: give --num-nvl-ranks and the internode mode"))
    setup = Setup.for_ranks(group.size, args.hidden, group.num_nvl_ranks)
    buffers = make_buffers(group, setup, args.modes)
    ctx = Context(setup, args.seed, args.rounds, args.check_every, group.rank, buffers,
                  {mode: ModeRun() for mode in args.modes})
    for first in (True, False):
        for mode in args.modes:
            run_pass(ctx, mode, first)
    # Closed only after a clean run: close is collective, and a rank that raised leaves the others in a kernel
    # (the launcher ends them).
    for buf in buffers.values():
        buf.close()
    gathered = group.allgather_object({mode: ctx.runs[mode].summary() for mode in args.modes})
    modes = {mode: merge(args.rounds, [g[mode] for g in gathered]) for mode in args.modes}
    ok = all(m["mismatched"] == 0 and m["failed"] == 0 and m["invalid"] == 0 for m in modes.values())
    result = {"rank": group.rank, "size": group.size, "num_nvl_ranks": group.num_nvl_ranks, "seed": args.seed,
              "rounds": args.rounds,
              "hidden": args.hidden, "normal_max_tokens": setup.normal_max_tokens,
              "ll_max_tokens": setup.ll_max_tokens, "check_every": args.check_every, "modes": modes, "ok": ok}
    if group.rank == 0:
        print(table(modes), flush=True)
        print("RESULT " + json.dumps(result), flush=True)
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"result": result, "per_rank": gathered}, f, indent=1, default=str)
    group.close()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
