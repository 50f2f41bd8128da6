import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)
# Ranks started by the forkserver import test modules by name; they need the repo on their path.
os.environ["PYTHONPATH"] = ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")
os.environ.setdefault("OMP_NUM_THREADS", "1")


def pytest_collection_modifyitems(config, items):
    """Tiers from what each test uses; tests marked ``cuda`` need a GPU, and on a CPU-only machine are skipped."""
    import torch

    _mark_tiers(items)
    _costliest_modules_first(items)
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (none on this machine)")
    for item in items:
        if item.get_closest_marker("cuda") is not None:  # the marker, not the keyword (tests/cuda/ is one)
            item.add_marker(skip)


def _mark_tiers(items):
    """Mark each test ``launch`` or ``spawn`` by what its module uses (``tests/helpers/tiers.py``)."""
    from tests.helpers.tiers import tier_of

    tiers: dict = {}
    for item in items:
        path = item.path
        if path not in tiers:
            tiers[path] = tier_of(path)
        if tiers[path]:
            item.add_marker(getattr(pytest.mark, tiers[path]))


def _costliest_modules_first(items):
    """Reorder in place: modules by CPU cost, highest first, each keeping its own order (``suite_order.py``);
    mark ``heavy`` the modules above ``HEAVY_CPU_S`` (left out of ``make test-quick``)."""
    from tests.helpers.cpu_meter import tier
    from tests.helpers.suite_order import HEAVY_CPU_S, costliest_first, module_cost, read_costs

    by_module: dict[str, list] = {}
    for item in items:
        by_module.setdefault(item.nodeid.split("::")[0], []).append(item)
    tiers = {m: tier(tests[0].keywords) for m, tests in by_module.items()}
    counts, costs = {m: len(t) for m, t in by_module.items()}, read_costs()
    for module, tests in by_module.items():
        if module_cost(module, tiers[module], counts[module], costs) > HEAVY_CPU_S:
            for item in tests:
                item.add_marker(pytest.mark.heavy)
    order = costliest_first(list(by_module), tiers, counts, costs)
    items[:] = [item for module in order for item in by_module[module]]


# --cpu-report N: CPU-seconds per test and tier (tests/helpers/cpu_meter.py); .ci/run prints it beside --durations.
_CPU_COSTS: list[tuple[str, str, float]] = []  # (nodeid, tier, CPU-seconds) from the teardown reports (xdist's too)


def pytest_addoption(parser):
    parser.addoption("--cpu-report", type=int, default=0, metavar="N",
                     help="print the suite's CPU-seconds, per tier and for the N costliest tests")
    parser.addoption("--write-module-costs", default=None, metavar="PATH",
                     help="with --cpu-report: write each module's CPU-seconds to PATH (tests/module_costs.txt "
                          "orders the suite, tests/helpers/suite_order.py)")


_CPU_START = pytest.StashKey[float]()


def pytest_runtest_setup(item):
    from tests.helpers.cpu_meter import cpu_now

    item.stash[_CPU_START] = cpu_now()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    if call.when == "teardown" and _CPU_START in item.stash:
        from tests.helpers.cpu_meter import KEY, cpu_now

        item.user_properties.append((KEY, cpu_now() - item.stash[_CPU_START]))
    yield


def pytest_runtest_logreport(report):
    if report.when == "teardown":
        from tests.helpers.cpu_meter import KEY, tier

        cost = dict(report.user_properties).get(KEY)
        if cost is not None:
            _CPU_COSTS.append((report.nodeid, tier(report.keywords), cost))


def pytest_terminal_summary(terminalreporter, config):
    top = config.getoption("--cpu-report")
    if top and _CPU_COSTS:
        from tests.helpers.cpu_meter import summary

        terminalreporter.write_sep("=", "CPU-seconds, each test's own processes included (tests/helpers/cpu_meter.py)")
        for line in summary(_CPU_COSTS, top):
            terminalreporter.write_line(line)
        path = config.getoption("--write-module-costs")
        if path:
            from tests.helpers.suite_order import module_costs, write_costs

            write_costs(module_costs(_CPU_COSTS), path)
