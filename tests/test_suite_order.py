"""The suite's order (tests/helpers/suite_order.py): costliest modules first, each module's tests kept together."""
from __future__ import annotations

from tests.helpers.suite_order import (HEAVY_CPU_S, PER_TEST, ROOT_DIR, costliest_first, module_cost, module_costs,
                                       read_costs, write_costs)
from tests.helpers.tiers import tier_of


def test_known_costs_first_then_unknown_by_tier_and_ties_keep_collection_order(tmp_path):
    costs = {"a.py": 5.0, "b.py": 50.0, "c.py": 5.0}
    tiers = {"a.py": "in-process", "b.py": "spawn", "c.py": "launch", "new_spawn.py": "spawn", "new.py": "in-process"}
    counts = {"a.py": 3, "b.py": 1, "c.py": 2, "new_spawn.py": 10, "new.py": 4}
    order = costliest_first(list(tiers), tiers, counts, costs)
    assert order == ["b.py", "new_spawn.py", "a.py", "c.py", "new.py"]  # 50, 24, 5, 5 (a before c), 0.4
    assert PER_TEST["spawn"] * 10 == 24.0


def test_module_costs_round_trip_through_the_file(tmp_path):
    tests = [("tests/x.py::t1", "spawn", 1.25), ("tests/x.py::t2[a::b]", "spawn", 2.0), ("tests/y.py::t", "", 9.0)]
    costs = module_costs(tests)
    assert costs == {"tests/x.py": 3.25, "tests/y.py": 9.0}
    path = tmp_path / "costs.txt"
    write_costs(costs, str(path))
    assert path.read_text().splitlines()[1:] == ["9.0 tests/y.py", "3.2 tests/x.py"]
    assert read_costs(str(path)) == {"tests/y.py": 9.0, "tests/x.py": 3.2}
    assert read_costs(str(tmp_path / "absent.txt")) == {}


def test_the_committed_file_names_this_suites_costliest_modules():
    costs = read_costs()
    assert costs, "tests/module_costs.txt is missing: the suite would run in collection order"
    assert max(costs, key=costs.get).startswith("tests/")


def test_heavy_marks_the_modules_above_the_threshold(request):
    """conftest marks ``heavy`` exactly the collected modules whose cost (file, or tier estimate) is above it."""
    costs = read_costs()
    for item in request.session.items:
        module = item.nodeid.split("::")[0]
        known = costs.get(module)
        if known is not None:
            assert (item.get_closest_marker("heavy") is not None) == (known > HEAVY_CPU_S), module
    assert module_cost("tests/moe/test_moe_training.py", "spawn", 1, costs) > HEAVY_CPU_S
    assert module_cost("new.py", "spawn", 9, {}) > HEAVY_CPU_S >= module_cost("new.py", "spawn", 8, {})


def test_the_quick_tier_fits_four_minutes_of_two_cores_by_the_recorded_costs():
    """``make test-quick`` (no launches, nothing heavy): its modules' recorded CPU-seconds over 2 cores, with a
    fifth left for pytest's own start and the workers' uneven ends, fit in 4 minutes."""
    quick = {m: c for m, c in read_costs().items()
             if (ROOT_DIR / m).exists() and tier_of(ROOT_DIR / m) != "launch" and c <= HEAVY_CPU_S}
    assert quick and sum(quick.values()) / 2 <= 0.8 * 240, sorted(quick.items(), key=lambda mc: -mc[1])[:10]
