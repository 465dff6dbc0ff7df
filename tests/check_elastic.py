# Many hosts and lost hosts, under the real torchrun (not tests/launch.py's forks: its rendezvous and its
# restarts are what is tested). Oracles: one process on the same global batch (losses, gradient norms,
# final weights), the uninterrupted run (every tensor of the final checkpoint, bit for bit)
"""Part of the suite: collected and run through test_all.py (`pytest test_all.py`).

Two torchrun launchers on this machine stand for two hosts (`--nnodes 2`, one c10d rendezvous); with
`--max-restarts 1` the job loses a rank to SIGKILL, torchrun restarts it on both hosts, and it finds its
own way back (`--resume auto`). Every rank is a fresh interpreter here (torchrun starts them), ~3.5 s
of CPU each before a line of ours runs: that is most of this file's time, and why one run holds both
items (the hosts, the restart) instead of two runs.
"""
import contextlib
import json
import os
import signal
import socket
import subprocess
import sys

import torch

from tests.check_parallel import _dp_args
from tests.common import HERE, TINY, _files, _main, _ranks_equal_one_process, losses, shared_run

TORCHRUN = [sys.executable, "-m", "torch.distributed.run"]
RESTARTABLE = {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}  # (a restart's workers get a store of their own: mesh.py)


def _free_port():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _records(out_dir):
    """Every record of metrics.jsonl in order (a step logged twice, before and after a restart, twice)."""
    with open(os.path.join(out_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def _hosts(argv, nproc, *flags, env=None):
    """Two real torchrun launchers standing for two hosts (`--nnodes 2`, one c10d rendezvous on
    localhost), each starting `nproc` ranks of `python *argv` (or of `python *argv[node]`, a list of
    two command lines: one per host): their Popen objects."""
    port = _free_port()
    per_host = argv if isinstance(argv[0], list) else [argv, argv]
    return [subprocess.Popen([*TORCHRUN, "--nnodes", "2", "--node-rank", str(node), "--nproc-per-node", str(nproc),
                              "--rdzv-backend", "c10d", "--rdzv-endpoint", f"localhost:{port}", "--rdzv-id", "job",
                              *flags, *per_host[node]], cwd=HERE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                             env={**os.environ, **(env or {})})
            for node in (0, 1)]


def _wait(launchers, timeout=300):
    """[(returncode, stdout, stderr)] of each launcher once it ends; none is left running."""
    try:
        ends = [p.communicate(timeout=timeout) for p in launchers]
        return [(p.returncode, out, err) for p, (out, err) in zip(launchers, ends)]
    finally:
        for p in launchers:
            p.kill()


def child_train_losing_a_rank(rank, step, *argv):
    """(child process, under torchrun) train.py, except that in the job's first attempt rank `rank`
    SIGKILLs itself once its step `step` is done (a host lost between two checkpoints); a restart
    (TORCHELASTIC_RESTART_COUNT 1) runs train.py as it is."""
    import faulthandler
    import train
    faulthandler.enable()
    if os.environ["TORCHELASTIC_RESTART_COUNT"] == "0" and os.environ["RANK"] == rank:
        train_step = train.Trainer.train_step

        def train_step_then_die(self):
            out = train_step(self)
            if self.step == int(step):
                os.kill(os.getpid(), signal.SIGKILL)
            return out
        train.Trainer.train_step = train_step_then_die
    code = train.main(list(argv))
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # (as process.main after a dead peer: no teardown waiting on it)


def _every_tensor(ckpt, path):
    """Every entry of a (sharded) DCP checkpoint as whole tensors, read by DCP alone (no model), through
    the torch.save file `path` (not beside a shared run's checkpoints)."""
    import warnings
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
    with warnings.catch_warnings():  # (DCP's note that this one process reads alone: as intended)
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp_to_torch_save(ckpt, path)
    flat = {}

    def walk(prefix, value):
        if isinstance(value, dict):
            for k, v in value.items():
                walk(f"{prefix}/{k}", v)
        else:
            flat[prefix] = value
    walk("", torch.load(path, weights_only=False))
    return flat


def test_hsdp_on_two_torchrun_hosts_equals_one_process_and_a_killed_rank_resumes_to_the_uninterrupted_weights(
        corpus, tmp_path, tmp_path_factory):
    """HSDP `--mesh dcn=2,ici=2` on two torchrun hosts (`--nnodes 2`, c10d rendezvous on localhost) of 2
    ranks each: ranks are numbered host by host, so each host's pair is one ici (shard) group and the
    dcn (replica) dim crosses the hosts. `--max-restarts 1` and one command line for every attempt
    (`--resume auto`, checkpoints at steps 4 and 8); rank 3 is SIGKILLed after step 6. Its host's
    torchrun restarts its ranks, the other host's rejoins the rendezvous and restarts its own, and all
    resume from step_000004 on their own (the run directory's locks and the watchdog are per process: a
    dead one holds nothing) and finish. Against the uninterrupted run (4 ranks on one host): every
    logged loss of both attempts (steps 5 and 6 twice) and every tensor of the final checkpoint
    (weights, both AdamW moments, step, RNG), bit for bit; against one process: losses, gradient norms,
    validation, final weights (1e-5)."""
    common = _dp_args("llama3_debug", corpus)
    hsdp, multi = [*common, "--mesh", "dcn=2,ici=2"], str(tmp_path / "multi")
    hosts = _hosts([os.path.join(HERE, "test_all.py"), "child_train_losing_a_rank", "3", "6", *hsdp,
                    "--ckpt-interval", "4", "--resume", "auto", "--out-dir", multi], 2, "--max-restarts", "1",
                   env=RESTARTABLE)
    try:  # the data-parallel tests' runs (one process; 4 forked ranks), while the hosts start
        single, full = shared_run(common, tmp_path_factory), shared_run([*hsdp, "--dp-impl", "simple"], tmp_path_factory, 4)
    finally:
        ends = _wait(hosts)
    err = "".join(e for _, _, e in ends)
    assert [rc for rc, _, _ in ends] == [0, 0], err[-6000:]
    # a launcher saw a worker fail (the killed one's -9, or first a peer's exit 4: whichever its monitor
    # polls first) and restarted: the second start record, resumed at step 4, says so
    assert "failed (exitcode: -9)" in err or "failed (exitcode: 4)" in err, err[-6000:]
    starts = [r for r in _records(multi) if r.get("event") == "start"]
    assert [(s["resumed_at"], s["devices"], s["hosts"]) for s in starts] == [(0, 4, 2), (4, 4, 2)], starts
    want, seen = losses(full), [(r["step"], r["loss"]) for r in _records(multi) if "loss" in r]
    assert [s for s, _ in seen] in ([1, 2, 3, 4, 5, 6, 5, 6, 7, 8, 9, 10], [1, 2, 3, 4, 5, 5, 6, 7, 8, 9, 10]), \
        seen  # (rank 0 may be stopped before it logs step 6)
    assert all(loss == want[step] for step, loss in seen), (want, seen)
    a, b = (_every_tensor(os.path.join(d, "checkpoints", "step_000010"), str(tmp_path / f"{i}.pt"))
            for i, d in enumerate((full, multi)))
    assert sorted(a) == sorted(b) and len(a) > 3 * 18, sorted(a)
    for name in a:
        assert torch.equal(a[name], b[name]), name
    assert int(b["/step"]) == 10
    _ranks_equal_one_process(single, multi, 10, common)


def test_resume_auto_starts_fresh_or_resumes_from_the_newest_checkpoint_that_verifies(corpus, tmp_path, capsys):
    """--resume auto on an empty directory starts at step 0; past a broken newest checkpoint (a truncated
    shard) it resumes from the newest good one, says so in one note and sets the broken one aside
    (kept), where bare --resume refuses naming it; the steps it trains again equal the first attempt's.
    Where no checkpoint verifies it refuses (starting over would overwrite them); without --resume a
    directory holding checkpoints is still refused."""
    out = str(tmp_path / "r")
    common = [*TINY, "--data", corpus, "--steps", "6", "--ckpt-interval", "2", "--eval-batches", "0", "--out-dir", out]
    assert _main([*common, "--resume", "auto", "--halt-at", "4"]) == 0
    assert "no checkpoint in" in capsys.readouterr().err
    shard = next(f for f in sorted(os.listdir(os.path.join(out, "checkpoints", "step_000004"))) if f.endswith(".distcp"))
    with open(os.path.join(out, "checkpoints", "step_000004", shard), "r+b") as f:
        f.truncate(100)
    assert _main(common) == 2 and "already holds checkpoints" in capsys.readouterr().err
    assert _main([*common, "--resume"]) == 2
    err = capsys.readouterr().err
    assert "step_000004 is broken" in err and "pass --resume-from step_000002" in err, err
    assert _main([*common, "--resume", "auto"]) == 0
    notes = [line for line in capsys.readouterr().err.splitlines() if line.startswith("note:")]
    assert len(notes) == 1 and "step_000004" in notes[0] and "resumes from the newest good one, step_000002" in notes[0]
    assert sorted(os.listdir(os.path.join(out, "checkpoints"))) == [  # (step 4 saved again, the broken one kept)
        "latest", "step_000002", "step_000004", "step_000004.superseded", "step_000006"]
    assert os.path.getsize(os.path.join(out, "checkpoints", "step_000004.superseded", shard)) == 100
    seen = [(r["step"], r["loss"]) for r in _records(out) if "loss" in r]
    assert [s for s, _ in seen] == [1, 2, 3, 4, 3, 4, 5, 6]
    assert seen[2:4] == seen[4:6]  # steps 3 and 4 again, bit for bit
    for step in ("step_000002", "step_000004", "step_000006"):  # none verifies: refused, nothing overwritten
        os.remove(os.path.join(out, "checkpoints", step, "meta.json"))
    before = _files(out)
    assert _main([*common, "--resume", "auto"]) == 2
    assert "no good checkpoint remains" in capsys.readouterr().err and _files(out) == before


def test_max_restarts_with_the_store_shared_with_the_ranks_is_refused_in_one_line(corpus, tmp_path, capsys, monkeypatch):
    """torchrun's default (the c10d rendezvous store shared with the ranks, TORCHELASTIC_USE_AGENT_STORE)
    with --max-restarts: a restart would read the dead attempt's addresses from that store (seen here: the
    restarted rank 0 connects to the killed rank's old port, connection refused, exit 4). Refused at the
    first start, before anything is written, naming the launch that works (the test above uses it); torchrun
    restarts the refused worker, whose restarts end with the same exit code and no second line."""
    for key, value in {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1",
                       "MASTER_PORT": "1", "TORCHELASTIC_MAX_RESTARTS": "3", "TORCHELASTIC_USE_AGENT_STORE": "True"}.items():
        monkeypatch.setenv(key, value)
    assert _main([*TINY, "--data", corpus, "--mesh", "ici=2", "--resume", "auto", "--out-dir", str(tmp_path / "r")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: torchrun --max-restarts") and "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1" in err, err
    assert err.count("\n") == 1 and not os.path.exists(tmp_path / "r")
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")  # torchrun restarts the refused worker: said once, not again
    assert _main([*TINY, "--data", corpus, "--mesh", "ici=2", "--resume", "auto", "--out-dir", str(tmp_path / "r")]) == 2
    assert capsys.readouterr().err == "" and not os.path.exists(tmp_path / "r")


def test_resume_auto_falls_back_to_the_newest_good_checkpoint_and_a_finished_run_is_complete(corpus, tmp_path, capsys):
    """Four checkpoints (steps 2, 4, 6, 8), the newest two broken: --resume auto resumes from step 4, the
    newest that verifies, not the oldest (step 2: two more steps trained again, without a word) nor a
    broken one; its note names the broken newest. Then --resume auto on the finished run (a restart after
    the final checkpoint) says the run is complete and exits 0, writing nothing; bare --resume still
    refuses (nothing to train), and the losses of steps 5-8 trained again are the first attempt's."""
    out = str(tmp_path / "r")
    common = [*TINY, "--data", corpus, "--steps", "8", "--ckpt-interval", "2", "--eval-batches", "0", "--out-dir", out]
    assert _main(common) == 0
    first = {r["step"]: r["loss"] for r in _records(out) if "loss" in r}
    for step in ("step_000006", "step_000008"):
        shard = next(f for f in sorted(os.listdir(os.path.join(out, "checkpoints", step))) if f.endswith(".distcp"))
        os.truncate(os.path.join(out, "checkpoints", step, shard), 100)
    capsys.readouterr()
    assert _main([*common, "--resume", "auto"]) == 0
    notes = [line for line in capsys.readouterr().err.splitlines() if line.startswith("note:")]
    assert len(notes) == 1 and "step_000008 is broken" in notes[0] and \
        "resumes from the newest good one, step_000004" in notes[0], notes
    starts = [r["resumed_at"] for r in _records(out) if r.get("event") == "start"]
    assert starts == [0, 4], starts
    again = [(r["step"], r["loss"]) for r in _records(out) if "loss" in r][8:]
    assert again == [(s, first[s]) for s in (5, 6, 7, 8)], again
    before = _files(out)
    assert _main([*common, "--resume", "auto"]) == 0
    err = capsys.readouterr().err
    assert err == f"note: {os.path.join(out, 'checkpoints', 'step_000008')} is the run's final checkpoint (step 8 " \
        "of --steps 8): the run is complete, nothing to train\n", err
    assert _main([*common, "--resume"]) == 2 and "nothing to train" in capsys.readouterr().err
    assert _files(out) == before


def test_two_launchers_with_different_meshes_are_refused_in_one_line_not_a_hang(corpus, tmp_path):
    """Host 0's torchrun passes `--mesh dcn=2,ici=1`, host 1's `--mesh ici=2` (both 2 ranks in all, so
    each passes its own world-size check): the ranks would build different sub-groups and wait on each
    other forever. Compared right after the process group exists: host 0 says it in one line naming both
    meshes, every rank exits 2, both launchers end (here within a minute; the hang was open-ended)."""
    import time
    common = [*TINY, "--data", corpus, "--steps", "2", "--eval-batches", "0", "--out-dir", str(tmp_path / "r")]
    started = time.monotonic()
    ends = _wait(_hosts([["train.py", *common, "--mesh", mesh] for mesh in ("dcn=2,ici=1", "ici=2")], 1), timeout=120)
    took = time.monotonic() - started
    lines = [line for _, _, err in ends for line in err.splitlines() if line.startswith("error:")]
    assert lines[:1] == ["error: the launchers disagree on the layout: rank 0 has --mesh 'dcn=2,ici=1' --dp-impl simple, "
                         "rank 1 has --mesh 'ici=2' --dp-impl simple (every host's torchrun must pass the same --mesh "
                         "and --dp-impl)"], [e[-3000:] for _, _, e in ends]
    assert [line for line in ends[0][2].splitlines() if line.startswith("error:")] == lines[:1]
    assert all(rc != 0 for rc, _, _ in ends) and "exitcode: 2" in ends[0][2], [e[-3000:] for _, _, e in ends]
    assert took < 90 and not os.path.exists(tmp_path / "r" / "checkpoints"), took


def _children(pid):
    """The pids of process `pid`'s children (Linux /proc)."""
    found = []
    for task in os.listdir(f"/proc/{pid}/task"):
        with open(f"/proc/{pid}/task/{task}/children") as f:
            found += [int(c) for c in f.read().split()]
    return found


def _alive(pid):
    """True while process `pid` runs (a zombie waiting for its new parent to reap it has ended)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_a_sigkilled_launcher_takes_its_rank_with_it(corpus, tmp_path):
    """Two launchers of one rank each; host 1's torchrun is SIGKILLed once training runs. Its rank (the
    kernel's parent-death signal) ends within seconds instead of training on as an orphan of PID 1, and
    the other host's rank then sees its peer gone: its launcher ends too."""
    import time
    out = str(tmp_path / "r")
    hosts = _hosts(["train.py", *TINY, "--data", corpus, "--steps", "100000", "--ckpt-interval", "0",
                    "--eval-batches", "0", "--mesh", "dcn=2,ici=1", "--watchdog", "60", "--out-dir", out], 1)
    ranks = []
    try:
        deadline = time.monotonic() + 120
        while not (os.path.exists(os.path.join(out, "metrics.jsonl")) and '"loss"' in open(os.path.join(out, "metrics.jsonl")).read()):
            assert time.monotonic() < deadline and all(p.poll() is None for p in hosts), "no step trained"
            time.sleep(0.2)
        ranks = [_children(p.pid) for p in hosts]
        (rank,) = ranks[1]
        hosts[1].kill()
        hosts[1].wait()
        gone = time.monotonic()
        while _alive(rank) and time.monotonic() < gone + 30:
            time.sleep(0.1)
        took = time.monotonic() - gone
        assert not _alive(rank), "the killed launcher's rank trains on as an orphan"
        assert took < 10, took
        hosts[0].wait(timeout=90)  # (its rank: the peer's connection closed, exit 4)
    finally:
        for pid in [p.pid for p in hosts] + [pid for pids in ranks for pid in pids]:  # (an orphan holds the pipes)
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        for p in hosts:
            p.communicate()
