"""conftest.py: how test_all.py's checks are spread over pytest-xdist's two workers (the README's test
command: `-n 2 --dist loadgroup`); a plain `pytest test_all.py` is untouched.

Each file of tests/ is one unit of work (an xdist group), run by one worker in the file's own order:
its tests share fixtures (the warm GRPO and vLLM starts, a layout's single-process oracle runs) and
some look at every process on the machine (no vLLM engine left). xdist hands the units out as workers
free up. Measured on this 2-core machine, on a smaller suite: 846 s against 931 s serial; the suite is CPU-bound (forked
ranks, XLA children, compiles), so a second worker mostly fills the waits (vLLM's imports, watchdogs).

`-m fast` picks the fast tier: one cheap oracle test per concept, marked `@pytest.mark.fast` in
tests/ (README, "Checking a change").
"""
import os

import pytest

if os.environ.get("PYTEST_XDIST_WORKER"):  # (xdist sets it before a worker loads this file, so before torch)
    # One intra-op thread in every process of the suite (workers, the fork server, their children;
    # torchrun's ranks have one already): two workers' processes fill the 2 cores, and OpenMP's second
    # thread mostly spun waiting for the first. Measured here, the CPU busy all along either way: 3 of
    # tests/' files in 175 s against 225 (OMP_WAIT_POLICY=PASSIVE alone: 195 s), 2 others in 203
    # against 218-222. The whole suite took 18.4 and 19.9 min with it against 18.2-21.0 without: the
    # gain is inside the run-to-run spread there. (-n 3 with two threads: 21.5 min.)
    os.environ.setdefault("OMP_NUM_THREADS", "1")


def pytest_configure(config):
    config.addinivalue_line("markers", "fast: the fast tier, one cheap oracle test per concept (pytest -m fast)")


@pytest.hookimpl(tryfirst=True)  # (before xdist's own, which reads the groups)
def pytest_collection_modifyitems(config, items):
    if not hasattr(config, "workerinput"):  # (only an xdist worker collects with this attribute)
        return
    for item in items:
        item.add_marker(pytest.mark.xdist_group(item.function.__module__.rsplit(".", 1)[-1]))
