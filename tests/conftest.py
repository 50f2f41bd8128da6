import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)
# Ranks started by the forkserver import test modules by name; they need the repo on their path.
os.environ["PYTHONPATH"] = ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")
os.environ.setdefault("OMP_NUM_THREADS", "1")


def pytest_collection_modifyitems(config, items):
    """Tiers from what each test uses; tests marked ``cuda`` need a GPU, and on a CPU-only machine are skipped."""
    import pytest
    import torch

    _mark_tiers(items)
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (none on this machine)")
    for item in items:
        if item.get_closest_marker("cuda") is not None:  # the marker, not the keyword (tests/cuda/ is one)
            item.add_marker(skip)


def _mark_tiers(items):
    """Mark each test ``launch`` or ``spawn`` by what its module uses (``tests/helpers/tiers.py``)."""
    import pytest

    from tests.helpers.tiers import tier_of

    tiers: dict = {}
    for item in items:
        path = item.path
        if path not in tiers:
            tiers[path] = tier_of(path)
        if tiers[path]:
            item.add_marker(getattr(pytest.mark, tiers[path]))
