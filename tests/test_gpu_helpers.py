"""The GPU tier's own helpers, on the CPU: what a failed multi-rank run shows."""

from __future__ import annotations

from .gpu import result_dicts, without_unload_noise

UNLOAD = """[rank {r}] Traceback (most recent call last):
[rank {r}]   File "cupy_backends/cuda/api/driver.pyx", line 247, in cupy_backends.cuda.api.driver.moduleUnload
[rank {r}]   File "cupy_backends/cuda/api/driver.pyx", line 73, in cupy_backends.cuda.api.driver.check_status
[rank {r}] cupy_backends.cuda.api.driver.CUDADriverError: CUDA_ERROR_LAUNCH_FAILED: unspecified launch failure
[rank {r}] Exception ignored in: 'cupy.cuda.function.Module.__dealloc__'"""

FIRST_ERROR = """[rank 5] Traceback (most recent call last):
[rank 5]   File "/repo/tests/ranks/intranode.py", line 360, in main
[rank 5]     d = buf.dispatch(x, topk_idx=idx, topk_weights=w, num_experts=64)
[rank 5] epjit.errors.EpjitTimeoutError: rank 5 timed out after 60.6 s in intranode_notify"""


def test_unload_noise_goes_and_the_real_error_stays_even_interleaved():
    lines = [*UNLOAD.format(r=6).splitlines()[:2], *FIRST_ERROR.splitlines()[:2],
             *UNLOAD.format(r=6).splitlines()[2:], *FIRST_ERROR.splitlines()[2:], *UNLOAD.format(r=4).splitlines(),
             "epjit.launch: rank 5 exited with code 1; stopping rank(s) 0, 1, 2, 3, 4, 6, 7"]
    out = without_unload_noise("\n".join(lines))
    assert out.splitlines()[:4] == FIRST_ERROR.splitlines()
    assert "moduleUnload" not in out and "__dealloc__" not in out
    assert "epjit.launch: rank 5 exited with code 1" in out
    assert out.endswith("(2 CuPy module-unload tracebacks after a lost CUDA context left out)")


def test_a_driver_error_raised_by_epjit_code_is_kept():
    text = """Traceback (most recent call last):
  File "/repo/epjit/buffer.py", line 210, in synchronize
  File "cupy_backends/cuda/api/driver.pyx", line 73, in cupy_backends.cuda.api.driver.check_status
cupy_backends.cuda.api.driver.CUDADriverError: CUDA_ERROR_LAUNCH_FAILED: unspecified launch failure"""
    assert without_unload_noise(text) == text


def test_results_are_read_where_two_ranks_share_a_line():
    stdout = ('[rank 1] noise\nRESULT {"rank": 0, "x": [1, 2]}RESULT {"rank": 6, "s": "a}b"}\n'
              'RESULT {"rank": 1}\nlast line\n')
    assert result_dicts(stdout) == [{"rank": 0, "x": [1, 2]}, {"rank": 6, "s": "a}b"}, {"rank": 1}]
