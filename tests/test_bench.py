"""The benchmark's command line without a GPU: its protocol rules hold before anything is timed."""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import asdict

import pytest

from epjit import bench


def test_fewer_than_twenty_repeats_are_refused(capsys):
    with pytest.raises(SystemExit) as e:
        bench.main(["--repeat", "5"])
    assert e.value.code == 2
    assert "--repeat must be >= 20" in capsys.readouterr().err


def test_ranks_sharing_gpus_are_not_timed(capsys, monkeypatch):
    monkeypatch.setenv("EPJIT_SHARE_GPUS", "1")
    with pytest.raises(SystemExit) as e:
        bench.main([])
    assert e.value.code == 2
    assert "time-sliced, so their timings mean nothing" in capsys.readouterr().err


def test_help_names_every_mode():
    out = subprocess.run([sys.executable, "-m", "epjit.bench", "--help"], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    for mode in ("dispatch", "dispatch-fp8", "combine", "ll-dispatch", "ll-combine", "ll-hook", "ceiling"):
        assert mode in out.stdout, mode


def test_summary_prints_earlier_rows_without_a_gpu(tmp_path, capsys):
    row = bench.Row("combine", 4096, 7168, 8, 256, 24, 4, 512.5, 640.0, 310.0, 420.0, 250.0, 1.25, 90.0)
    path = tmp_path / "rows.json"
    path.write_text(json.dumps({"meta": {}, "rows": [asdict(row)]}))
    assert bench.main(["--summary", str(path)]) == 0
    (line,) = [line for line in capsys.readouterr().out.splitlines() if line.startswith("combine")]
    assert line.split()[:6] == ["combine", "4096", "7168", "24", "4", "512.5"]
    assert "1.25" in line.split()


@pytest.mark.parametrize("ranks", [2, 4])
def test_each_operation_is_timed_with_its_own_default_chunk(ranks):
    from epjit.config import get_combine_config, get_dispatch_config

    for mode, default in (("combine", get_combine_config(ranks)), ("dispatch", get_dispatch_config(ranks)),
                          ("dispatch-fp8", get_dispatch_config(ranks))):
        cfg = bench.case_config(mode, ranks, 24, 0, 256)
        assert (cfg.num_sms, cfg.nvl_chunk_send, cfg.nvl_chunk_recv) == (24, default.nvl_chunk_send, 256), mode
    assert bench.case_config("combine", ranks, 16, 20, 256).nvl_chunk_send == 20  # --chunk-send wins
    # On 2 ranks the two defaults differ, which is what the benchmark once missed.
    assert ranks != 2 or get_combine_config(2).nvl_chunk_send != get_dispatch_config(2).nvl_chunk_send


def test_a_warp_role_run_is_timed_with_its_own_chunks():
    """With --warp-roles (scripts/gpu_variants.sh) each case gets the chunks a plain call with those roles gets: a
    phased dispatch sends 48-token chunks on 4 ranks (12 warps in one group), a 5-sender combine 15 rows."""
    roles = bench.parse_roles(" dispatch_phased=1, combine_send_warps=5 ")
    assert roles == {"dispatch_phased": 1, "combine_send_warps": 5}
    dispatch = bench.case_config("dispatch", 4, 24, 0, 256, roles)
    combine = bench.case_config("combine", 4, 24, 0, 256, roles)
    assert dispatch.nvl_chunk_send == 48 and combine.nvl_chunk_send == 15
    assert dispatch.dispatch_phased and combine.combine_send_warps == 5  # the calls run those roles' kernel
    assert bench.parse_roles("") == {}
    for bad in ("dispatch_phased", "dispatch_phased=yes", "=3", "num_sms=3"):
        with pytest.raises(ValueError, match="is not FIELD=INTEGER"):
            bench.parse_roles(bad)
