"""scripts/with_stack_dumps.py, which scripts/sanitize.sh puts before a case's script (SANITIZE_STACK_DUMP_S): the
script runs as itself (its arguments, its folder first on sys.path, its exit code) and its stacks reach stderr."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TOOL = ROOT / "scripts" / "with_stack_dumps.py"


def _run(script: Path, *args: str, every: str = "0.2") -> subprocess.CompletedProcess:
    env = {**os.environ, "STACK_DUMP_S": every}
    return subprocess.run([sys.executable, str(TOOL), str(script), *args], env=env, capture_output=True, text=True,
                          timeout=60)


def test_the_script_runs_as_itself_and_its_stack_is_dumped_while_it_waits(tmp_path):
    (tmp_path / "beside.py").write_text("VALUE = 7\n")
    script = tmp_path / "slow.py"
    script.write_text("import sys, time\nimport beside\nprint(sys.argv[1:], beside.VALUE, __name__)\n"
                      "time.sleep(1.0)\nsys.exit(3)\n")
    proc = _run(script, "a", "--b")
    assert proc.returncode == 3, proc.stderr
    assert proc.stdout.strip() == "['a', '--b'] 7 __main__"
    assert f'File "{script}", line 4' in proc.stderr, proc.stderr  # the sleep, seen from outside


def test_a_bad_interval_or_no_script_is_refused(tmp_path):
    script = tmp_path / "quick.py"
    script.write_text("print('ran')\n")
    for every in ("0", "soon"):
        proc = _run(script, every=every)
        assert proc.returncode != 0 and "STACK_DUMP_S must be a positive number" in proc.stderr, proc.stderr
        assert "ran" not in proc.stdout
    proc = subprocess.run([sys.executable, str(TOOL)], capture_output=True, text=True, timeout=60)
    assert proc.returncode != 0 and "usage" in proc.stderr
