"""The benchmark's command line without a GPU: its protocol rules hold before anything is timed."""

from __future__ import annotations

import subprocess
import sys

import pytest

from epjit import bench


def test_fewer_than_twenty_repeats_are_refused(capsys):
    with pytest.raises(SystemExit) as e:
        bench.main(["--repeat", "5"])
    assert e.value.code == 2
    assert "--repeat must be >= 20" in capsys.readouterr().err


def test_help_names_every_mode():
    out = subprocess.run([sys.executable, "-m", "epjit.bench", "--help"], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    for mode in ("dispatch", "dispatch-fp8", "combine", "ll-dispatch", "ll-combine", "ll-hook", "ceiling"):
        assert mode in out.stdout, mode
