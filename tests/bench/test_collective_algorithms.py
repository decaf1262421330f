"""`bench/collective_algorithms.py`: a plan simulated with its all-reduces forced to each
algorithm, beside the algorithm the machine's prices choose."""

from __future__ import annotations

from bench import collective_algorithms
from partitioner import collectives
from partitioner.machine import Machine


def test_each_algorithm_is_simulated_and_the_chosen_one_is_what_the_prices_pick(capsys):
    machine = Machine()
    original = collectives.allreduce_algorithm
    with collective_algorithms.all_reduces_by("tree"):
        assert collectives.allreduce_algorithm(4, 1 << 26, machine)[0] == "tree"
        assert collectives.allreduce_algorithm(2, 1 << 26, machine)[0] == "ring"  # two: as chosen
    assert collectives.allreduce_algorithm is original
    found = collective_algorithms.compare("seed-lcn-small", 4, "data", 8, machine)
    assert collectives.allreduce_algorithm is original
    # on 4 ranks the weights' gradients halve and double (`collective_prices.allreduce_algorithm`)
    assert found["chosen"] == found["halving"]
    assert found["ring"] != found["halving"] and found["tree"] != found["halving"]
    assert all(found[name] > 0 for name in ("chosen", "ring", "halving", "tree", "summed"))
    assert collective_algorithms.main(["seed-lcn-small:4:data:8"]) == 0
    assert "seed-lcn-small:4:data:8" in capsys.readouterr().out
    assert collective_algorithms.main(["seed-lcn-small:four:data"]) == 2
