"""The layer-wise placement of DP-KFAC (schedule/layer_placement.py), against hand-computed cases."""

import itertools

import pytest

from lightning_spdkfac.schedule import InverseCost, layer_state_bytes, plan_layer_placement


def test_state_bytes_counts_factors_and_inverses():
    assert layer_state_bytes(3, 2) == (2 * 9 + 2 * 4) * 4
    assert layer_state_bytes(3, 2, bytes_per_element=8, inverse_method="eigen") == (2 * 9 + 2 * 4 + 3 + 2) * 8


def test_lpt_by_time_hand_computed():
    inv = InverseCost(c3=1.0)  # time n^3; preconditioning 2ag(a+g)
    sides = [(4, 1), (3, 1), (2, 2), (1, 1)]
    seconds = [a**3 + g**3 + 2 * a * g * (a + g) for a, g in sides]  # 105, 52, 48, 6
    p = plan_layer_placement(sides, 2, inv)
    # largest first to the least loaded: 105 -> r0, 52 -> r1, 48 -> r1 (52 < 105), 6 -> r1 (100 < 105)
    assert p.owners == (0, 1, 1, 1)
    assert p.load == (seconds[0], seconds[1] + seconds[2] + seconds[3])
    assert p.memory == (layer_state_bytes(4, 1),
                        layer_state_bytes(3, 1) + layer_state_bytes(2, 2) + layer_state_bytes(1, 1))
    assert p.owned_by(1) == [1, 2, 3]


def test_zero_model_balances_memory_and_is_near_optimal():
    sides = [(577, 64), (577, 64), (289, 64), (289, 32), (145, 32), (145, 16), (28, 16), (65, 10)]
    for world in (2, 3):
        p = plan_layer_placement(sides, world, InverseCost())
        total = sum(layer_state_bytes(a, g) for a, g in sides)
        best = min(max(sum(layer_state_bytes(*sides[i]) for i, o in enumerate(owners) if o == r) for r in range(world))
                   for owners in itertools.product(range(world), repeat=len(sides)))
        assert sum(p.memory) == total
        assert max(p.memory) <= best * 4 / 3  # LPT's bound
        assert max(p.memory) == p.memory[0] or len(set(p.owners)) == world


def test_one_rank_owns_everything_and_errors_name_the_argument():
    p = plan_layer_placement([(3, 2), (5, 5)], 1, InverseCost(c3=1.0))
    assert p.owners == (0, 0)
    with pytest.raises(ValueError, match="world_size"):
        plan_layer_placement([(3, 2)], 0, InverseCost())
    with pytest.raises(ValueError, match="balance"):
        plan_layer_placement([(3, 2)], 2, InverseCost(), balance="speed")


def test_preconditioned_order_by_predicted_finish():
    from lightning_spdkfac.schedule import preconditioned_order

    inv = InverseCost(c3=1.0)
    sides = [(4, 1), (1, 1), (2, 1), (1, 1)]
    owners = [0, 1, 1, 0]
    t = [a**3 + g**3 + 2 * a * g * (a + g) for a, g in sides]  # 105, 6, 21, 6
    done = [t[0], t[1], t[1] + t[2], t[0] + t[3]]  # each owner in layer order: 105, 6, 27, 111
    assert done == [105, 6, 27, 111]
    assert preconditioned_order(sides, owners, inv) == (1, 2, 0, 3)
    assert preconditioned_order(sides, owners, InverseCost()) == (0, 1, 2, 3)  # no model: layer order
    with pytest.raises(ValueError, match="same length"):
        preconditioned_order(sides, owners[:2], inv)
