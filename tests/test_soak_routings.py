"""CPU tier of scripts/soak_routings.py: its rounds repeat from their seeds and reach the edges they promise (ranks
with no tokens, ranks that receive nothing, all slots holes), the Buffers it makes fit, the inputs the GPU generates
are the host's (one integer recipe), and its checks catch what they must: a changed bit fails, low-latency source
blocks in another order pass, a layout_range that does not tile its rows is reported. Where torch is installed, the
GPU half's digests and low-latency gather also run on CPU tensors: the checksum is the sum it promises, mod 2**64, and
every flipped bit tried changes it. The GPU half of the script runs in the GPU tier (test_gpu_soak.py)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import numpy as np
import pytest

from epjit import reference
from epjit.buffer import Buffer
from epjit.kernels.low_latency import LOW_LATENCY_MAX_TOPK, MAX_DYNAMIC_SHARED_BYTES, dispatch_shared_bytes

ROOT = Path(__file__).resolve().parents[1]


def _load():
    spec = importlib.util.spec_from_file_location("soak_routings", ROOT / "scripts" / "soak_routings.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the file runs
    spec.loader.exec_module(module)
    return module


soak = _load()
SMALL = soak.Setup(ranks=2, hidden=256, normal_max_tokens=64, ll_max_tokens=32, ll_experts=8)


def _rounds(mode, count=400, setup=SMALL, seed=3):
    for r in range(count):
        params = soak.round_params(setup, seed, r, mode)
        yield r, params, soak.all_inputs(setup, params, seed, r)


@pytest.mark.parametrize("mode", soak.MODES)
def test_rounds_repeat_from_their_seeds_and_reach_the_edges(mode):
    seen = {"no tokens": 0, "most tokens": 0, "avoided": 0, "all holes": 0, "holes": 0, "uneven": 0}
    for r, params, inputs in _rounds(mode):
        again = soak.round_params(SMALL, 3, r, mode)
        assert (again.num_experts, again.topk, again.holes, again.avoided) == (
            params.num_experts, params.topk, params.holes, params.avoided)
        assert np.array_equal(again.popularity, params.popularity)
        local = params.num_experts // SMALL.ranks
        for rank, got in enumerate(inputs):
            same = soak.rank_inputs(SMALL, params, 3, r, rank)
            assert np.array_equal(same.topk_idx, got.topk_idx) and np.array_equal(same.topk_weights, got.topk_weights)
            assert same.salts == got.salts
            idx = got.topk_idx
            assert idx.dtype == np.int64 and idx.shape == (got.num_tokens, params.topk) and idx.flags.c_contiguous
            assert got.topk_weights.dtype == np.float32 and got.topk_weights.shape == idx.shape
            assert 0 <= got.num_tokens <= params.max_tokens
            assert idx.size == 0 or (idx.min() >= -1 and idx.max() < params.num_experts)
            named = idx[idx >= 0]
            assert params.avoided < 0 or not np.any(named // local == params.avoided)
            for row in idx:  # distinct experts a token
                row = row[row >= 0]
                assert len(set(row.tolist())) == len(row)
            seen["no tokens"] += got.num_tokens == 0
            seen["most tokens"] += got.num_tokens == params.max_tokens
            seen["holes"] += bool(np.any(idx < 0))
        seen["avoided"] += params.avoided >= 0
        seen["all holes"] += params.holes == 1.0
        seen["uneven"] += bool(np.ptp(params.popularity) > 0)
    assert all(seen.values()), seen
    # the same round of another seed is another round
    other = soak.rank_inputs(SMALL, soak.round_params(SMALL, 4, 7, mode), 4, 7, 0)
    mine = soak.rank_inputs(SMALL, soak.round_params(SMALL, 3, 7, mode), 3, 7, 0)
    assert other.salts != mine.salts


@pytest.mark.parametrize("ranks", [1, 2, 3, 4, 8])
@pytest.mark.parametrize("hidden", [1024, 2048, 7168])
def test_the_buffers_fit(ranks, hidden):
    """The low-latency Buffer stages every top-k entry of its tokens (top-16) in shared memory: the script's most
    tokens must fit, and 4096 (what normal mode takes) must not, or the script could take more."""
    setup = soak.Setup.for_ranks(ranks, hidden)
    assert dispatch_shared_bytes(hidden, setup.ll_max_tokens, LOW_LATENCY_MAX_TOPK,
                                 setup.ll_experts, ranks) <= MAX_DYNAMIC_SHARED_BYTES
    if ranks <= 2:
        assert setup.ll_max_tokens == 3072
        assert dispatch_shared_bytes(hidden, 4096, LOW_LATENCY_MAX_TOPK, setup.ll_experts,
                                     ranks) > MAX_DYNAMIC_SHARED_BYTES
    assert setup.ll_experts % ranks == 0
    assert Buffer.get_low_latency_size_hint(setup.ll_max_tokens, hidden, ranks, setup.ll_experts) > 0
    assert Buffer.get_normal_size_hint(ranks, hidden, soak.MAX_TOPK, ranks * max(soak.NORMAL_LOCAL_EXPERTS)) > 0


def _hash32(value, salt):
    """hash32 in plain Python integers: the arrays' int64 arithmetic must not have overflowed anywhere."""
    v = (value ^ salt) & 0xFFFFFFFF
    v ^= v >> 16
    v = (v * 0x7FEB352D) & 0xFFFFFFFF
    v ^= v >> 15
    v = (v * 0x2C1B3C6D) & 0xFFFFFFFF
    return v ^ (v >> 16)


def test_generated_inputs_are_finite_and_the_same_through_either_conversion():
    index = np.arange(1 << 16, dtype=np.int64)
    for salt in (0, 1, 0xDEADBEEF, 0xFFFFFFFF):
        h = soak.hash32(index, salt)
        assert h.min() >= 0 and h.max() <= 0xFFFFFFFF
        assert [int(v) for v in h[:50]] == [_hash32(i, salt) for i in range(50)]
        assert int(h[-1]) == _hash32(int(index[-1]), salt)
        bits = soak.bf16_bits(h)
        x = bits.astype(np.uint16).view(reference.BF16).astype(np.float32)
        assert np.all(np.isfinite(x)) and np.all(np.abs(x) >= 0.125) and np.all(np.abs(x) < 64)
        # the GPU converts through int16 (signed16), the host through uint16: the same bits
        assert np.array_equal(soak.signed16(bits).astype(np.int16).view(np.uint16), bits.astype(np.uint16))
        q = soak.fp8_bits(h)
        assert q.min() >= 0 and q.max() <= 255 and not np.any((q & 0x7F) == 0x7F)
        assert np.all(np.isfinite(reference.fp8_bits_to_float32(q.astype(np.uint8))))
        s = soak.scale_bits(h).astype(np.uint32).view(np.float32)
        assert np.all(s >= 2.0**-9) and np.all(s < 0.5)
    inputs = soak.RankInputs(np.zeros((5, 2), np.int64), np.zeros((5, 2), np.float32), (1, 2, 3))
    x, scales = soak.host_x(inputs, 256, False)
    assert x.dtype == reference.BF16 and x.shape == (5, 256) and scales is None
    assert len(np.unique(x.view(np.uint16))) > 200  # not a constant
    q, scales = soak.host_x(inputs, 256, True)
    assert q.dtype == np.uint8 and scales.dtype == np.float32 and scales.shape == (5, 2)
    assert not np.array_equal(soak.host_bias(inputs, 256), x)  # another salt, other values
    empty = soak.RankInputs(np.zeros((0, 2), np.int64), np.zeros((0, 2), np.float32), (1, 2, 3))
    assert soak.host_x(empty, 256, False)[0].shape == (0, 256)


def _flip(outputs, name):
    changed = dict(outputs)
    a = np.ascontiguousarray(outputs[name]).copy()
    flat = a.reshape(-1).view(np.uint8)
    flat[len(flat) // 2] ^= 1
    changed[name] = a
    return changed


@pytest.mark.parametrize("mode", soak.MODES)
def test_reference_outputs_pass_their_checks_and_a_changed_bit_does_not(mode):
    checked = 0
    for _r, params, inputs in _rounds(mode, count=40):
        want = soak.EXPECTED[mode](SMALL, params, inputs, 0)
        again = soak.EXPECTED[mode](SMALL, params, inputs, 0)
        assert soak.compare(again, want) == []
        assert soak.digests(again) == soak.digests(want)
        if want["combined_x"].size == 0:
            continue
        changed = _flip(want, "combined_x")
        problems = soak.compare(changed, want)
        assert len(problems) == 1 and problems[0].startswith("combined_x: 1 of"), problems
        differ = [n for n, d in soak.digests(changed).items() if d != soak.digests(want)[n]]
        assert differ == ["combined_x"]
        checked += 1
    assert checked >= 10
    missing = dict(want)
    del missing["combined_x"]
    assert soak.compare(missing, want) == ["combined_x: only in the reference"]


LL_ROWS = SMALL.ranks * SMALL.ll_max_tokens  # rows an expert of SMALL's low-latency arrays has


def _gpu_order(want):
    """A low-latency result as a kernel may lay it out: [L, LL_ROWS, ...] arrays, each expert's source blocks in
    reverse rank order, the rows past its recv_count poison (every bit set), and the layout_range saying so."""
    counts, recv = want["block_counts"], want["recv_count"]
    starts = np.concatenate(([0], np.cumsum(recv)))
    layout = np.zeros(counts.shape, np.int64)
    raw = {"recv_count": recv, "layout_range": layout, "combined_x": want["combined_x"]}
    for name in ("src_info", "x", "x_scales"):
        if name in want:
            raw[name] = np.empty((len(recv), LL_ROWS) + want[name].shape[1:], want[name].dtype)
            raw[name].view(np.uint8)[...] = 0xFF
    for e in range(counts.shape[0]):
        canonical_begin = np.concatenate(([0], np.cumsum(counts[e])[:-1]))
        begin = 0
        for s in reversed(range(counts.shape[1])):
            layout[e, s] = reference.pack_layout_range(begin, counts[e, s])
            rows = starts[e] + canonical_begin[s] + np.arange(counts[e, s])
            for name in ("src_info", "x", "x_scales"):
                if name in want:
                    raw[name][e, begin:begin + counts[e, s]] = want[name][rows]
            begin += counts[e, s]
    return raw


def _canonical(raw):
    """low_latency_outputs' gather, in numpy: canonical_order's index into each array's rows."""
    order, problem = soak.canonical_order(raw["recv_count"], raw["layout_range"], LL_ROWS)
    assert order.dtype == np.int64
    assert np.all((order >= 0) & (order < len(raw["recv_count"]) * LL_ROWS))  # in bounds, whatever the layout says
    canon = {"recv_count": raw["recv_count"], "block_counts": reference.unpack_layout_range(raw["layout_range"])[1],
             "combined_x": raw["combined_x"]}
    for name in ("src_info", "x", "x_scales"):
        if name in raw:
            canon[name] = raw[name].reshape((-1,) + raw[name].shape[2:])[order]
    return canon, problem


def _two_source_round():
    for _r, params, inputs in _rounds("low_latency", count=100):
        want = soak.expected_low_latency(SMALL, params, inputs, 0)
        if np.any((want["block_counts"] > 0).all(axis=1)):  # an expert with rows from both ranks
            return want
    pytest.fail("no round sends one expert rows from both ranks")


def test_low_latency_blocks_in_another_order_pass_and_a_layout_that_does_not_tile_is_reported():
    want = _two_source_round()
    raw = _gpu_order(want)
    canon, problem = _canonical(raw)
    assert problem is None and soak.compare(canon, want) == []
    assert soak.digests(canon) == soak.digests(want)
    # in the reference's order already: unchanged
    ref_order = {**raw, "layout_range": reference.pack_layout_range(
        np.concatenate([np.zeros((len(want["recv_count"]), 1), np.int64),
                        np.cumsum(want["block_counts"], axis=1)[:, :-1]], axis=1), want["block_counts"])}
    moved = False
    for name in ("src_info", "x", "x_scales"):
        if name in want:
            ref_order[name] = raw[name].copy()
            valid = np.arange(LL_ROWS)[None, :] < want["recv_count"][:, None]
            moved |= not np.array_equal(raw[name][valid], want[name])  # the blocks did move
            ref_order[name][valid] = want[name]
    assert moved
    canon, problem = _canonical(ref_order)
    assert problem is None and soak.compare(canon, want) == []
    # a block one row too long overlaps the next one
    e = int(np.flatnonzero((want["block_counts"] > 0).all(axis=1))[0])
    broken = {**raw, "layout_range": raw["layout_range"].copy()}
    broken["layout_range"][e, 1] += 1
    canon, problem = _canonical(broken)
    assert problem.startswith(f"expert {e}: layout_range blocks"), problem
    assert len(canon["src_info"]) == want["recv_count"].sum()  # the rows as received, so the round has digests
    # a recv_count past the expert's rows: reported, and the gather stays in bounds
    over = {**raw, "recv_count": raw["recv_count"].copy()}
    over["recv_count"][e] = LL_ROWS + 1
    canon, problem = _canonical(over)
    assert problem == f"expert {e}: recv_count {LL_ROWS + 1} is not in 0..{LL_ROWS}", problem
    assert len(canon["src_info"]) == want["recv_count"].sum() - want["recv_count"][e] + LL_ROWS


# ---------------------------------------------------------------------------------------------------- torch
# The GPU half's code on CPU torch tensors, where torch is installed (the project's environment has none).

MASK64 = (1 << 64) - 1


def _checksum_py(data: bytes):
    """checksum in Python integers, reduced mod 2**64 by hand: torch's int64 arithmetic must have wrapped exactly."""
    wide = len(data) % 4 == 0
    words = np.frombuffer(data, np.int32 if wide else np.uint8).tolist()
    k1, k2 = soak.CHECK_K1 & MASK64, soak.CHECK_K2 & MASK64
    s1 = s2 = 0
    for i, w in enumerate(words):
        m = ((2 * i + 1) * k1) & MASK64
        s1 += (w & MASK64) * m
        s2 += (w & MASK64) ^ ((m * k2) & MASK64)
    return [v - (1 << 64) if v >= 1 << 63 else v for v in (s1 & MASK64, s2 & MASK64)]


def _tensors(torch):
    """Tensors of every dtype the soak digests, odd sizes (bytes read one by one) and even, with extreme words."""
    rng = np.random.default_rng(7)
    bits = rng.integers(0, 256, size=4 * 1024 + 3, dtype=np.uint8)
    bits[:16] = 0xFF  # words of -1 and of the most negative int32: the products wrap
    bits[16:20] = [0, 0, 0, 0x80]
    t = torch.from_numpy(bits.copy())
    return {"bf16": t[:2048].view(torch.bfloat16).view(32, 32), "fp8": t[:1024].view(torch.float8_e4m3fn),
            "float32": t[:1024].view(torch.float32).view(16, 16), "int64": t[:1024].view(torch.int64),
            "int32": t[12:24].view(torch.int32), "bool": (t[:37] & 1).bool().view(37, 1), "uint8 odd": t[:4099]}


def test_checksum_is_the_sum_it_promises_and_a_changed_bit_or_moved_word_changes_it():
    torch = pytest.importorskip("torch")
    for name, t in _tensors(torch).items():
        raw = t.contiguous().view(torch.uint8).reshape(-1)
        base = soak.checksum(t)
        assert base.dtype == torch.int64 and base.shape == (2,)
        assert base.tolist() == _checksum_py(raw.numpy().tobytes()), name
        assert torch.equal(soak.checksum(t.clone()), base)
        n = raw.numel()
        for byte in sorted({0, 1, 3, n // 2, n - 1}):  # every bit of a few bytes, the last included
            for bit in range(8):
                flipped = raw.clone()
                flipped[byte] ^= 1 << bit
                if t.dtype == torch.bool and flipped[byte] > 1:
                    continue  # not a bool's bits
                changed = flipped.view(t.dtype).view(t.shape) if t.dtype != torch.uint8 else flipped
                got = soak.checksum(changed)
                assert got[0] != base[0] and got[1] != base[1], (name, byte, bit)
        swapped = raw.clone()
        a, b = int(torch.argmax(raw)), int(torch.argmin(raw))
        assert raw[a] != raw[b]
        swapped[a], swapped[b] = raw[b], raw[a]
        assert not torch.equal(soak.checksum(swapped), soak.checksum(raw)), name  # same bytes, other places
    empty = torch.zeros((0, 256), dtype=torch.bfloat16)
    assert soak.checksum(empty).tolist() == [0, 0]
    # a view that starts inside a word (storage offset 1) is summed as its own bytes
    bytes_ = torch.arange(13, dtype=torch.uint8)
    assert torch.equal(soak.checksum(bytes_[1:]), soak.checksum(bytes_[1:].clone()))


def _torch(torch, a, dtype=None):
    """A reference array as the tensor the GPU would hold: bf16 as bf16, FP8 bytes as float8 where ``dtype`` says."""
    t = torch.from_numpy(np.ascontiguousarray(a).view(np.int16) if a.dtype == reference.BF16 else a.copy())
    return t.view(torch.bfloat16) if a.dtype == reference.BF16 else t.view(dtype) if dtype else t


@pytest.mark.parametrize("mode", soak.MODES)
def test_digests_of_tensors_change_with_one_bit_and_their_host_copies_pass_the_check(mode):
    torch = pytest.importorskip("torch")
    checked = 0
    for _r, params, inputs in _rounds(mode, count=30):
        want = soak.EXPECTED[mode](SMALL, params, inputs, 0)
        fp8 = torch.float8_e4m3fn if params.fp8 or params.precision != "bf16" else None
        tensors = {n: a if n in ("num_recv_tokens_per_expert", "recv_count", "block_counts")
                   else _torch(torch, a, fp8 if n == "x" else None) for n, a in want.items()}
        assert soak.compare(soak.host_outputs(tensors), want) == []
        base = soak.digests(tensors)
        assert soak.digests({n: t.clone() if isinstance(t, torch.Tensor) else t for n, t in tensors.items()}) == base
        for name in ("x", "combined_x"):
            if want[name].size == 0:
                continue
            changed = dict(tensors)
            flat = tensors[name].clone().contiguous().view(torch.uint8).reshape(-1)
            flat[len(flat) // 2] ^= 1
            changed[name] = flat.view(tensors[name].dtype).view(tensors[name].shape)
            differ = [n for n, d in soak.digests(changed).items() if d != base[n]]
            assert differ == [name]
            checked += 1
    assert checked >= 10


def test_low_latency_outputs_gather_each_experts_rows_in_rank_order():
    torch = pytest.importorskip("torch")
    want = _two_source_round()
    raw = _gpu_order(want)
    fp8 = torch.float8_e4m3fn if "x_scales" in want else None
    arrays = {n: _torch(torch, raw[n], fp8 if n == "x" else None) for n in ("src_info", "x", "x_scales") if n in raw}
    out, problem = soak.low_latency_outputs(torch.from_numpy(raw["recv_count"]), torch.from_numpy(raw["layout_range"]),
                                            arrays, _torch(torch, raw["combined_x"]))
    assert problem is None
    assert out["recv_count"].dtype == np.int32
    assert soak.compare(soak.host_outputs(out), want) == []
    canon = {n: _torch(torch, a, fp8 if n == "x" else None) if n in arrays else a for n, a in want.items()}
    assert soak.digests(out) == soak.digests({**canon, "combined_x": out["combined_x"]})
