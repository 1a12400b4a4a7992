"""The ILP against brute force, and its determinism."""
import itertools

import numpy as np
import pytest

from autopar.solve.ilp.formulation import InfeasibleError, evaluate, solve


def random_graph(rng, n_nodes, max_choices=4, edge_p=0.5):
    costs = [rng.uniform(0, 10, size=rng.integers(1, max_choices + 1)) for _ in range(n_nodes)]
    memory = [rng.uniform(0, 5, size=len(c)) for c in costs]
    edges = []
    for u in range(n_nodes):
        for v in range(u + 1, n_nodes):
            if rng.random() < edge_p:
                m = rng.uniform(0, 10, size=(len(costs[u]), len(costs[v])))
                m[rng.random(m.shape) < 0.3] = 0.0   # resharding is often free
                edges.append((u, v, m))
    return costs, memory, edges


def brute_force(costs, memory, edges, budget):
    best = None
    for choice in itertools.product(*[range(len(c)) for c in costs]):
        if budget is not None and sum(memory[n][i] for n, i in enumerate(choice)) > budget:
            continue
        value = evaluate(costs, edges, choice)
        if best is None or value < best[0]:
            best = (value, choice)
    return best


@pytest.mark.parametrize("seed", range(24))
def test_ilp_equals_brute_force(seed):
    rng = np.random.default_rng(seed)
    costs, memory, edges = random_graph(rng, n_nodes=int(rng.integers(3, 7)))
    budget = None
    if seed % 2:  # half the graphs get a memory budget that binds
        lo = sum(m.min() for m in memory)
        hi = sum(m.max() for m in memory)
        budget = lo + 0.4 * (hi - lo)
    expected, _ = brute_force(costs, memory, edges, budget)
    sol = solve(costs, edges, memory, budget)
    assert sol.optimal and sol.gap == 0.0
    got = evaluate(costs, edges, sol.choice)
    # the objective is solved in integers scaled to ~1e9 over the sum of costs
    assert got == pytest.approx(expected, rel=1e-6, abs=1e-6)
    if budget is not None:
        # memory is compared in KiB inside the solver; with these byte-sized numbers the
        # ceiling rounding of each term makes the constraint slightly stricter, never looser
        assert sum(memory[n][i] for n, i in enumerate(sol.choice)) <= budget


def test_allowed_mask_and_infeasible_budget():
    costs = [np.array([1.0, 5.0]), np.array([2.0, 1.0])]
    edges = [(0, 1, np.array([[0.0, 10.0], [10.0, 0.0]]))]
    sol = solve(costs, edges, None, None, [np.array([False, True]), None])
    assert sol.choice == (1, 1)
    assert evaluate(costs, edges, sol.choice) == pytest.approx(6.0)
    with pytest.raises(InfeasibleError):
        solve(costs, edges, [np.array([4096.0, 4096.0]), np.array([4096.0, 4096.0])], 1024.0)


def test_same_inputs_same_answer():
    rng = np.random.default_rng(7)
    costs, memory, edges = random_graph(rng, 12, max_choices=6, edge_p=0.3)
    assert solve(costs, edges, memory, None).choice == solve(costs, edges, memory, None).choice


def test_price_tables_shared_between_problems_on_equal_meshes_price_alike():
    """Problems built on equal meshes share one table of layout-pair prices
    (cost/layout_prices.shared_prices); the second problem's edge costs are those a fresh
    table gives, for another batch size too (a pair's price depends on the layouts and the
    mesh alone), and an unequal mesh gets its own table."""
    import autopar
    from autopar.cost import layout_prices
    from autopar.models import build
    from autopar.solve.built import build_problem

    def costs(batch):
        model, example = build("gpt-tiny", device="meta", batch=batch)
        problem = build_problem(model, autopar.Mesh((2, 4), ("dp", "tp"), device="h100"), example, None).problem
        return problem, {key: m.copy() for key, m in problem.edge_prices.costs.items()}

    layout_prices._SHARED.clear()
    first, _ = costs(8)
    shared, got = costs(16)
    assert shared.edge_prices.prices is first.edge_prices.prices
    layout_prices._SHARED.clear()
    fresh, expected = costs(16)
    assert fresh.edge_prices.prices is not first.edge_prices.prices
    assert got.keys() == expected.keys()
    for key in got:
        np.testing.assert_array_equal(got[key], expected[key])
    other = autopar.Mesh((2, 4), ("dp", "tp"), device="h100", bandwidth=(1e9, 1e9))
    assert layout_prices.shared_prices(other) is not fresh.edge_prices.prices
