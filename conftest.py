"""conftest.py: how test_all.py's checks are spread over pytest-xdist's two workers (the README's test
command: `-n 2 --dist loadgroup`); a plain `pytest test_all.py` is untouched.

Each file of tests/ is one unit of work (an xdist group), run by one worker in the file's own order:
its tests share fixtures (the warm GRPO and vLLM starts, a layout's single-process oracle runs) and
some look at every process on the machine (no vLLM engine left). xdist hands the units out as workers
free up. Measured on this 2-core machine, when the suite was smaller: 846 s against 931 s serial;
it is CPU-bound (forked ranks, XLA children, compiles), so a second worker mostly fills the waits
(vLLM's imports, watchdogs).

The files are handed out heaviest first (HEAVIEST_FIRST), the longest job first and the short ones
filling in at the end; xdist's own order is by test count, which handed out some files of a few long
compiles last. Measured here, one run each with `--durations`: 1182 s in xdist's order, 1094 s in
this one, where the tests' own durations add up to 2162 s (1081 s a worker, were the two kept even):
the suite's time is its work, shared by two workers.

`-m fast` picks the fast tier: one cheap oracle test per concept, marked `@pytest.mark.fast` in
tests/ (README, "Checking a change").
"""
import pytest


# tests/ files by their seconds in the suite (--durations=0 on two workers here), heaviest first; a file
# not named goes after these, in collection order
HEAVIEST_FIRST = ["check_step_compile", "check_parallel", "check_flux_trainer", "check_expert_exchange", "check_vllm",
                  "check_context_parallel", "check_accum", "check_graph", "check_grpo", "check_kernels", "check_layer_scan",
                  "check_elastic", "check_materialize", "check_checkpoint", "check_flux", "check_flux_pipeline",
                  "check_model"]


def pytest_configure(config):
    config.addinivalue_line("markers", "fast: the fast tier, one cheap oracle test per concept (pytest -m fast)")
    if hasattr(config.option, "loadscopereorder"):  # (xdist's: hand the groups out in collection order)
        config.option.loadscopereorder = False


@pytest.hookimpl(tryfirst=True)  # (before xdist's own, which reads the groups)
def pytest_collection_modifyitems(config, items):
    if not hasattr(config, "workerinput"):  # (only an xdist worker collects with this attribute)
        return
    file_of = lambda item: item.function.__module__.rsplit(".", 1)[-1]
    rank = {name: i for i, name in enumerate(HEAVIEST_FIRST)}
    items.sort(key=lambda item: rank.get(file_of(item), len(rank)))  # (stable: each file keeps its order)
    for item in items:
        item.add_marker(pytest.mark.xdist_group(file_of(item)))
