"""Variants of the built-in kernels (epjit.lab.variant, use_variant; epjit.bench.variant.compare): an edited
low_latency.cu compiles for sm_90 without a GPU into a cache entry of its own, a replacement that does not occur and
kernels that no longer take the built-in's arguments are refused before anything compiles, compile errors quote the
edited text, the swap on a Buffer (a stand-in here) restores the built-in module, and the checks against
epjit.reference find a changed row. The notebook's GPU run (tests/test_notebooks.py) launches a variant and times
it."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

import epjit.lab
from epjit import reference
from epjit.bench.variant import Comparison
from epjit.errors import ArgumentError, CompileError
from epjit.jit import compile_spec
from epjit.kernels import LowLatencySpec, cuda_sources, jit_config
from epjit.lab import variants as lab_variants

from .test_lab import _cache, _cubins  # noqa: F401  (the lab's own cache a test, and its cubins)

pytest.importorskip("cuda.bindings.nvrtc", reason="cuda-bindings (NVRTC) not installed")

IN_FLIGHT = "constexpr int kInFlight = 8;  // 32 registers of 64 (1024 threads a block)"
DISPATCH_HEAD = ("ll_dispatch(const PeersTable* peers, const int4* x, const int64_t* topk_idx, int num_tokens, "
                 "int num_topk,")


def test_the_texts_the_tests_edit_are_in_the_source():
    text = (cuda_sources() / LowLatencySpec.SOURCE).read_text()
    assert IN_FLIGHT in text and DISPATCH_HEAD in text, "update this test: low_latency.cu changed"


def test_a_variant_compiles_for_sm_90_with_a_cache_key_of_its_own(tmp_path):
    """A changed constant made a define compiles without a GPU; its entry is neither the built-in's nor another
    define's, and the same variant again is a hit."""
    four = epjit.lab.variant("low_latency", replace={IN_FLIGHT: "constexpr int kInFlight = LAB_IN_FLIGHT;"},
                             defines={"LAB_IN_FLIGHT": 4}, name="in_flight", arch="sm_90")
    compiled = four.compiled()
    assert not compiled.from_cache and compiled.cubin_path.stat().st_size > 0
    assert compiled.cubin_path.name.startswith("variant.in_flight.low_latency.")
    assert set(compiled.lowered_names) == set(LowLatencySpec.KERNELS) and four.replaced == {IN_FLIGHT: 1}
    assert four.defines == ("LAB_IN_FLIGHT=4",) and "kInFlight = LAB_IN_FLIGHT" in four.text
    two = epjit.lab.variant("low_latency", replace={IN_FLIGHT: "constexpr int kInFlight = LAB_IN_FLIGHT;"},
                            defines={"LAB_IN_FLIGHT": 2}, name="in_flight", arch="sm_90")
    built_in = compile_spec(LowLatencySpec(), "sm_90", jit_config())
    paths = {four.compiled().cubin_path, two.compiled().cubin_path, built_in.cubin_path}
    assert len(paths) == 3, paths
    again = epjit.lab.variant("low_latency", replace={IN_FLIGHT: "constexpr int kInFlight = LAB_IN_FLIGHT;"},
                              defines={"LAB_IN_FLIGHT": 4}, name="in_flight", arch="sm_90")
    assert again.compiled().from_cache and again.compiled().cubin_path == compiled.cubin_path


def test_an_edited_copy_of_the_file_compiles(tmp_path):
    copy = tmp_path / "my_low_latency.cu"
    copy.write_text((cuda_sources() / "low_latency.cu").read_text().replace(IN_FLIGHT, "constexpr int kInFlight = 4;"))
    made = epjit.lab.variant("low_latency", source=copy, arch="sm_90")
    assert made.program_name == str(copy) and made.compiled().cubin_path.is_file()


def test_a_replacement_that_does_not_occur_is_refused_naming_it(tmp_path):
    with pytest.raises(ArgumentError, match=r"'constexpr int kInFlight = 16;' does not occur in low_latency.cu"):
        epjit.lab.variant("low_latency", replace={"constexpr int kInFlight = 16;": "x"}, arch="sm_90")
    with pytest.raises(ArgumentError, match=r"its first line is at line \d+: 'constexpr int kInFlight = 8;"):
        epjit.lab.variant("low_latency", replace={"constexpr int kInFlight = 8;\nint extra;": "x"}, arch="sm_90")
    with pytest.raises(ArgumentError, match=r"no family 'intranod' has variants; the families: \['low_latency'\]"):
        epjit.lab.variant("intranod", arch="sm_90")
    assert _cubins(tmp_path) == []


def test_kernels_that_differ_from_the_built_in_are_refused_before_the_compile(tmp_path):
    """Two int parameters swapped: the launch would pack the built-in's order into them. Refused, naming the
    parameter and its line, before NVRTC runs."""
    swapped = DISPATCH_HEAD.replace("int num_tokens, int num_topk", "int num_topk, int num_tokens")
    with pytest.raises(ArgumentError, match=r"variant low_latency cannot run in place of LowLatencySpec's kernels: "
                                            r"<variant low_latency of low_latency.cu>:\d+: ll_dispatch's parameter "
                                            r"4 is 'int num_topk', the built-in's is 'int num_tokens'"):
        epjit.lab.variant("low_latency", replace={DISPATCH_HEAD: swapped}, arch="sm_90")
    assert _cubins(tmp_path) == []


def test_signature_problems_name_a_missing_kernel_and_a_changed_count():
    spec = LowLatencySpec()
    text = (cuda_sources() / spec.SOURCE).read_text()
    kernels = dict(epjit.jit.parse_globals(text, "v.cu"))
    assert lab_variants.signature_problems(spec, kernels, "v.cu") == []
    del kernels["ll_combine_logfmt"]
    dropped = text.replace("int64_t* wait_stats) {\n    combine<false>", "int64_t* wait_stats, int extra) {\n"
                           "    combine<false>")
    assert dropped != text
    kernels["ll_combine"] = epjit.jit.parse_globals(dropped, "v.cu")["ll_combine"]
    problems = lab_variants.signature_problems(spec, kernels, "v.cu")
    assert len(problems) == 2, problems
    assert problems[0].endswith("ll_combine takes 21 parameters, the built-in 20 (added: 'int extra')")
    assert problems[1] == "v.cu has no __global__ function ll_combine_logfmt"


def test_a_compile_error_quotes_the_edited_text(tmp_path):
    with pytest.raises(CompileError) as caught:
        epjit.lab.variant("low_latency", replace={IN_FLIGHT: "constexpr int kInFlight = in_flight;"},
                          name="broken", arch="sm_90")
    said = str(caught.value)
    assert "<variant broken of low_latency.cu>(" in said and "identifier \"in_flight\" is undefined" in said
    assert "> " in said and "kInFlight = in_flight;" in said


def _stand_in(pending: list[str | None] | None = None) -> SimpleNamespace:
    ops = SimpleNamespace(module=SimpleNamespace(spec=LowLatencySpec()), device=0, pending=pending or [None, None])
    return SimpleNamespace(_low_latency=SimpleNamespace(ops=ops))


def test_use_variant_swaps_the_module_and_restores_it(monkeypatch):
    """The module the Buffer's low-latency calls launch is the variant's inside the with and the built-in's after,
    also when the body raises; a pending receive hook refuses the swap at either end."""
    made = lab_variants.make_variant("low_latency", None, {}, (), "same", "sm_90")
    loads = []
    monkeypatch.setattr(lab_variants.Variant, "module",
                        lambda self, spec, device: loads.append((spec, device)) or "variant module")
    buffer = _stand_in()
    built_in = buffer._low_latency.ops.module
    with epjit.lab.use_variant(buffer, made) as module:
        assert module == "variant module" and buffer._low_latency.ops.module == "variant module"
    assert buffer._low_latency.ops.module is built_in and loads == [(LowLatencySpec(), 0)]
    with pytest.raises(RuntimeError, match="in the body"), epjit.lab.use_variant(buffer, made):
        raise RuntimeError("in the body")
    assert buffer._low_latency.ops.module is built_in
    with pytest.raises(ArgumentError, match="receive hook of low_latency_dispatch has not run: call it first"):
        with epjit.lab.use_variant(_stand_in(["low_latency_dispatch", None]), made):
            pass
    with pytest.raises(ArgumentError, match="has not run inside the with"), epjit.lab.use_variant(buffer, made):
        buffer._low_latency.ops.pending[1] = "low_latency_combine"
    assert buffer._low_latency.ops.module is built_in
    with pytest.raises(ArgumentError, match="runs no low-latency kernels"):
        with epjit.lab.use_variant(SimpleNamespace(_low_latency=SimpleNamespace()), made):
            pass


def _routing(seed: int = 0) -> tuple[list[np.ndarray], list[np.ndarray]]:
    rng = np.random.default_rng(seed)
    counts, hidden, experts = [3, 5], 128, 4
    xs = [rng.standard_normal((n, hidden), dtype=np.float32).astype(reference.BF16) for n in counts]
    idxs = [np.argsort(rng.random((n, experts)), axis=1)[:, :2].astype(np.int64) for n in counts]
    return xs, idxs


def test_the_reference_checks_find_a_changed_row():
    xs, idxs = _routing()
    want = reference.low_latency_dispatch(xs, idxs, 8, 4, use_fp8=True)
    assert lab_variants.dispatch_problems(want[1], want[1]) == []
    got = reference.low_latency_dispatch(xs, idxs, 8, 4, use_fp8=True)[1]
    expert = int(np.flatnonzero(got.recv_count)[0])
    got.x[expert, 0, 0] ^= 1
    got.x_scales[expert, 0, 0] *= 2
    assert epjit.lab.dispatch_problems(got, want[1]) == [f"x[{expert}] differs", f"x_scales[{expert}] differs"]
    got.recv_count[expert] += 1
    assert epjit.lab.dispatch_problems(got, want[1]) == ["recv_count differs"]
    ys = [r.x.astype(np.float32).astype(reference.BF16) for r in reference.low_latency_dispatch(xs, idxs, 8, 4)]
    ws = [np.full(i.shape, 0.5, dtype=np.float32) for i in idxs]
    combined = reference.low_latency_combine(ys, idxs, ws, [r.handle for r in reference.low_latency_dispatch(
        xs, idxs, 8, 4)])
    assert epjit.lab.combine_problems(combined[0], combined[0]) == []
    assert epjit.lab.combine_problems(combined[1], combined[0]) == ["combined x differs"]


def test_a_comparison_reads_as_one_line():
    same = Comparison("in_flight_4", 31.25, 30.5, (), (), 20)
    assert str(same) == ("variant in_flight_4: 31.2 us, built-in 30.5 us (median of 20 CUDA-graph replays, this "
                         "rank); both match the reference") and same.matches
    wrong = Comparison("v", 1.0, 2.0, ("x[0] differs",), (), 5)
    assert not wrong.matches and str(wrong).endswith("; variant: x[0] differs")
