"""GPU tier of the routing soak (scripts/soak_routings.py): 200 rounds of random routings through each mode on 2 ranks,
run twice in one process, every round bit-identical between the passes, every 50th round equal to epjit.reference.
The long soak (10,000 rounds) is the same script with its defaults."""

from __future__ import annotations

import pytest

from .gpu import run_ranks, two_ranks

pytestmark = pytest.mark.gpu


def test_random_routings_repeat_bit_for_bit_and_match_the_reference():
    env = two_ranks()
    pytest.importorskip("torch")
    code, output, results = run_ranks("launch", 2, "scripts/soak_routings.py", "--rounds", "200", "--check-every",
                                      "50", env={"EPJIT_TIMEOUT_S": "60", **env}, timeout=240)
    assert code == 0, output[-8000:]
    assert len(results) == 1 and results[0]["ok"], output[-8000:]
    modes = results[0]["modes"]
    assert set(modes) == {"normal", "low_latency"}, modes
    for mode, m in modes.items():
        assert m["rounds"] == 200, (mode, m)
        assert m["mismatched"] == 0 and m["failed"] == 0 and m["invalid"] == 0, (mode, m)
        assert m["checks"] == 4, (mode, m)
    print(output[-3000:])
