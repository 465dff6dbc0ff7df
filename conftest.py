"""conftest.py: how test_all.py's checks are spread over pytest-xdist's two workers (the README's test
command: `-n 2 --dist loadgroup`); a plain `pytest test_all.py` is untouched.

Each file of tests/ is one unit of work, run by one worker in the file's own order: its tests share
fixtures (the warm GRPO and vLLM starts, a layout's single-process oracle runs) and some look at every
process on the machine (no vLLM engine left). The units are this file's scheduler's (OneFileOneUnit),
not xdist_group marks: xdist 3.8 sends a mark's group to its scheduler as a suffix written into the
test's node id, which pytest 9.2's node ids no longer take, so the marks were silently ignored and a
file's tests ran on both workers at once (pytest-xdist issue #1386). The heaviest files go first
(HEAVIEST), so that no long file starts last while the other worker idles.

`-m fast` picks the fast tier: one cheap oracle test per concept, marked `@pytest.mark.fast` in
tests/ (README, "Checking a change").
"""
import os
import pathlib
import re

import pytest

if os.environ.get("PYTEST_XDIST_WORKER"):  # (xdist sets it before a worker loads this file, so before torch)
    # One intra-op thread in every process of the suite (workers, the fork server, their children;
    # torchrun's ranks have one already): two workers' processes fill the 2 cores, and OpenMP's second
    # thread mostly spun waiting for the first. Measured here, the CPU busy all along either way: 3 of
    # tests/' files in 175 s against 225 (OMP_WAIT_POLICY=PASSIVE alone: 195 s), 2 others in 203
    # against 218-222. (-n 3 with two threads took longer.)
    os.environ.setdefault("OMP_NUM_THREADS", "1")

# XLA:CPU's code generation at LLVM's -O0 in every process of the suite (torch_xla's and jax's CPU
# clients read XLA_FLAGS when they start): the same optimized HLO and buffer assignment (checked, byte
# for byte, in both), its loops compiled unoptimized; the suite's XLA:CPU programs are small, so their
# compile is their cost.
# Measured here: FLUX's 2-device SPMD run 32.7 s -> 15.4 s (48 -> 17 CPU-s), the same losses to the
# printed digit. The TPU compiler (libtpu, tpu_pod/target.py) is not LLVM's: the same report with it.
if "xla_backend_optimization_level" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} --xla_backend_optimization_level=0".strip()

# tests/' files whose tests take longest together, longest first (docs/verified.md has the measured
# times); the others follow in xdist's order (most tests first)
HEAVIEST = ("check_step_compile", "check_parallel", "check_expert_exchange", "check_layer_scan", "check_flux_trainer",
            "check_context_parallel", "check_tpu_compile", "check_grpo")


def pytest_configure(config):
    config.addinivalue_line("markers", "fast: the fast tier, one cheap oracle test per concept (pytest -m fast)")


def file_of_each_test():
    """{test function's name: its file's stem} over tests/check_*.py, read as text (no import here:
    the controller process collects nothing)."""
    files = {}
    for path in sorted(pathlib.Path(__file__).parent.glob("tests/check_*.py")):
        for name in re.findall(r"^def (test_\w+)", path.read_text(), re.M):
            files[name] = path.stem
    return files


@pytest.hookimpl(optionalhook=True)  # (xdist's hook: test_torch_tpu.py runs in .venv-tpu, which has no xdist)
def pytest_xdist_make_scheduler(config, log):
    if config.getvalue("dist") != "loadgroup":
        return None
    from xdist.scheduler import LoadScopeScheduling
    files = file_of_each_test()

    class OneFileOneUnit(LoadScopeScheduling):
        """xdist's scope scheduler with a test's scope its file (test_all.py::test_x[...] -> check_y)."""
        ordered = False

        def _split_scope(self, nodeid):
            return files.get(nodeid.split("::")[-1].split("[")[0], nodeid)

        def _assign_work_unit(self, node):
            if not self.ordered:  # (the first hand-out: the work queue is complete)
                self.ordered = True
                for name in reversed(HEAVIEST):
                    if name in self.workqueue:
                        self.workqueue.move_to_end(name, last=False)
            super()._assign_work_unit(node)
    return OneFileOneUnit(config, log)
