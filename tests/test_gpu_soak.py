"""GPU tier of the routing soak (scripts/soak_routings.py): 200 rounds of random routings through each mode on 2 ranks,
run twice in one process, every round bit-identical between the passes, every 50th round equal to epjit.reference:
inside one NVLink node (normal and low-latency modes) and across two (2 ranks as 2 nodes of 1: internode and
low-latency modes). The long soak (10,000 rounds) is the same script with its defaults."""

from __future__ import annotations

import pytest

from .gpu import run_ranks, two_ranks

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("nodes", [pytest.param((), id="one-node"), pytest.param(("--num-nvl-ranks", "1"), id="2x1")])
def test_random_routings_repeat_bit_for_bit_and_match_the_reference(nodes):
    env = two_ranks()
    pytest.importorskip("torch")
    code, output, results = run_ranks("launch", 2, "scripts/soak_routings.py", "--rounds", "200", "--check-every",
                                      "50", *nodes, env={"EPJIT_TIMEOUT_S": "60", **env}, timeout=300)
    assert code == 0, output[-8000:]
    assert len(results) == 1 and results[0]["ok"], output[-8000:]
    modes = results[0]["modes"]
    assert set(modes) == ({"internode", "low_latency"} if nodes else {"normal", "low_latency"}), modes
    assert results[0]["num_nvl_ranks"] == (1 if nodes else 2), results[0]
    for mode, m in modes.items():
        assert m["rounds"] == 200, (mode, m)
        assert m["mismatched"] == 0 and m["failed"] == 0 and m["invalid"] == 0, (mode, m)
        assert m["checks"] == 4, (mode, m)
    print(output[-3000:])
