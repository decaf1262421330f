"""`bench/simulated_vs_summed.py`: a plan's simulated step beside its bulk-synchronous sum."""

from __future__ import annotations

from bench import simulated_vs_summed
from partitioner.machine import Machine


def test_a_plan_on_free_links_simulates_within_its_sum_and_bad_cases_exit_2(capsys):
    free = Machine(link_gbytes_per_s=1e6, latency_us=1e-6)
    found = simulated_vs_summed.compare("seed-lcn-small", 3, "spatial", 8, free)
    # with links that cost nothing the runtime overlaps what the sum adds up task by task
    assert 0 < found["simulated"] <= found["summed"] + 1e-12
    assert found["seconds"] > 0
    assert simulated_vs_summed.main(["seed-lcn-small:2:data:8"]) == 0
    assert "seed-lcn-small:2:data:8" in capsys.readouterr().out
    assert simulated_vs_summed.main(["seed-lcn-small:two:data"]) == 2
    assert "is not NETWORK:RANKS:STRATEGY[:BATCH]" in capsys.readouterr().err
