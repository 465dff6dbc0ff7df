"""The suite's way of starting processes (tests/launch.py: forks of a server that has imported torch)
shows a script what `python` and `torchrun` show it. Oracles: a real `python -c` subprocess, started
the ordinary way, for what a child sees and how it ends; for ranks, arithmetic (an all-reduce of known
numbers) and torchrun's contract (its environment variables; the others ended when one rank fails)."""
import json
import os
import re
import signal
import subprocess
import sys
import time

from tests import launch
from tests.common import HERE

PROBE = """import importlib.util, json, os, sys, torch
print(json.dumps({"argv": sys.argv, "name": __name__, "cwd": os.getcwd(), "env": os.environ.get("PROBE"),
                  "threads": torch.get_num_threads(), "lazy": [m in sys.modules for m in ("torch_xla", "jax")],
                  "pythonpath": importlib.util.find_spec("minititan_probe") is not None}))
sys.stdout.flush()
how = sys.argv[1]
if how == "exit": sys.exit(3)
if how == "signal": os.kill(os.getpid(), 15)
if how == "raise": 1 / 0
if how == "os_exit": os._exit(5)
"""


def test_a_forked_child_is_a_fresh_process(tmp_path):
    """What a child sees (argv, __name__, cwd, the environment, torch's thread count, torch_xla and jax
    not yet imported, a module found on its PYTHONPATH) equals a real `python -c` subprocess's; it
    ends as Python does, as subprocess reports it: sys.exit(3) -> 3, SIGTERM -> -15, an uncaught
    exception -> 1 with its traceback, os._exit(5) -> 5."""
    (tmp_path / "minititan_probe.py").write_text("")
    env = {"PROBE": "x", "OMP_NUM_THREADS": "2", "PYTHONPATH": str(tmp_path)}  # (the suite's server has 1: conftest.py)
    real = subprocess.run([sys.executable, "-c", PROBE, "exit"], cwd=HERE, capture_output=True, text=True,
                          timeout=120, env={**os.environ, **env})
    for how, code in (("exit", 3), ("signal", -signal.SIGTERM), ("raise", 1), ("os_exit", 5)):
        rc, out, err = launch.python(["-c", PROBE, how], env=env, timeout=120)
        seen = json.loads(out)
        assert rc == code and seen == {**json.loads(real.stdout), "argv": ["-c", how]}, (how, rc, out, err)
        assert ("ZeroDivisionError" in err) == (how == "raise"), err
    assert real.returncode == 3 and json.loads(real.stdout)["pythonpath"]


RANKS = r"""import os, sys, time, torch, torch.distributed as dist
if sys.argv[1] == "fail":
    rank = int(os.environ["RANK"])
    sys.exit(7) if rank == 1 else time.sleep(600)
dist.init_process_group("gloo")
x = torch.tensor([float(dist.get_rank() + 1)])
dist.all_reduce(x)
sys.stdout.write(f"rank {dist.get_rank()} of {dist.get_world_size()} local {os.environ['LOCAL_RANK']} sum {x.item()} "
                 f"threads {torch.get_num_threads()}\n")  # (one write: the ranks share stdout)
dist.destroy_process_group()
"""


def test_ranks_get_torchruns_contract_and_one_failure_ends_the_others():
    """launch.ranks: each rank has torchrun's RANK / LOCAL_RANK / WORLD_SIZE, one intra-op thread, and a
    working rendezvous (an all-reduce of 1..n sums to n(n+1)/2); when one rank exits 7 the other (asleep
    for 600 s) is ended at once and the run's code is 7."""
    rc, out, err = launch.ranks(3, ["-c", RANKS, "ok"], timeout=120)
    assert rc == 0, err[-2000:]
    lines = sorted(line for line in out.splitlines() if line.startswith("rank "))  # (gloo prints its own too)
    assert lines == [f"rank {r} of 3 local {r} sum 6.0 threads 1" for r in range(3)], out
    start = time.time()
    rc, _, err = launch.ranks(2, ["-c", RANKS, "fail"], timeout=120)
    assert rc == 7 and time.time() - start < 30, (rc, err[-2000:])


def test_the_two_workers_run_each_file_of_tests_whole():
    """The README's test command (`-n 2 --dist loadgroup`, conftest.py's scheduler) on a few quick tests
    of two files: every test of a file ran on one worker, and conftest's map of tests to files, read
    from the files' text, is the one their imports give (each function's module). Oracle: xdist's own
    report of which worker ran what. Fails where the files' tests are dealt out one by one (pytest
    9.2 with xdist_group marks: tests/check_model.py's 6 spread over both workers)."""
    import conftest
    import test_all
    files = conftest.file_of_each_test()
    imported = {n: f.__module__.rsplit(".", 1)[-1] for n, f in vars(test_all).items() if n.startswith("test_") and callable(f)}
    assert files == imported, set(files.items()) ^ set(imported.items())
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_")}  # (a fresh session, not this worker's)
    out = subprocess.run([sys.executable, "-m", "pytest", "-v", "-n", "2", "--dist", "loadgroup", "-p", "no:cacheprovider",
                          "test_all.py", "-k", "causality_future or model_logits_equal_the_architecture or forked_child"],
                         cwd=HERE, env=env, capture_output=True, text=True, timeout=600).stdout
    ran = {}
    for worker, name in re.findall(r"\[(gw\d)\] \[ *\d+%\] PASSED test_all.py::(test_\w+)", out):
        ran.setdefault(files[name], set()).add(worker)
    assert set(ran) == {"check_model", "check_launch"} and out.count(" PASSED ") == 7 and "FAILED" not in out, out[-3000:]
    assert all(len(workers) == 1 for workers in ran.values()), (ran, out[-3000:])
