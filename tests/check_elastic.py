# Many hosts and lost hosts, under the real torchrun (not tests/launch.py's forks: its rendezvous and its
# restarts are what is tested). Oracles: one process on the same global batch (losses, gradient norms,
# final weights), the uninterrupted run (every tensor of the final checkpoint, bit for bit)
"""Part of the suite: collected and run through test_all.py (`pytest test_all.py`).

Two torchrun launchers on this machine stand for two hosts (`--nnodes 2`, one c10d rendezvous); one
launcher with `--max-restarts 1` loses a rank to SIGKILL and restarts the job, which finds its own way
back (`--resume auto`). Every rank is a fresh interpreter here (torchrun starts them), ~3.5 s of CPU
each before a line of ours runs: that is most of these tests' time.
"""
import json
import os
import signal
import socket
import subprocess
import sys

import torch

from tests.check_parallel import _dp_args
from tests.common import HERE, TINY, _main, _ranks_equal_one_process, background, losses, shared_run, start_record

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


def test_hsdp_across_two_torchrun_hosts_equals_one_process(corpus, tmp_path, tmp_path_factory):
    """`--mesh dcn=2,ici=2` on two torchrun launchers (`--nnodes 2`, c10d rendezvous on localhost), 2 ranks
    each: ranks are numbered node by node, so each host's two ranks are one ici (shard) group and the
    dcn (replica) dim crosses the hosts. Equal to one process: losses, gradient norms, validation, final
    weights; the run says it ran on 4 devices of 2 hosts."""
    common = _dp_args("llama3_debug", corpus)
    multi, port = str(tmp_path / "multi"), _free_port()
    hosts = [subprocess.Popen([*TORCHRUN, "--nnodes", "2", "--node-rank", str(node), "--nproc-per-node", "2",
                               "--rdzv-backend", "c10d", "--rdzv-endpoint", f"localhost:{port}", "--rdzv-id", "hsdp",
                               os.path.join(HERE, "train.py"), *common, "--mesh", "dcn=2,ici=2", "--out-dir", multi],
                              cwd=HERE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for node in (0, 1)]
    try:
        single = shared_run(common, tmp_path_factory)  # (the data-parallel tests' oracle; meanwhile the hosts start)
        ends = [h.communicate(timeout=300) for h in hosts]
    finally:
        for h in hosts:
            h.kill()
    assert [h.returncode for h in hosts] == [0, 0], [err[-3000:] for _, err in ends]
    start = start_record(multi)
    assert (start["devices"], start["hosts"]) == (4, 2), start
    _ranks_equal_one_process(single, multi, 10, common)


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
    os._exit(code)  # (as train.py's __main__ after a dead peer: no teardown waiting on it)


def _every_tensor(ckpt):
    """Every entry of a (sharded) DCP checkpoint as whole tensors, read by DCP alone (no model)."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
    path = ckpt + ".pt"
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


def test_a_rank_killed_mid_run_restarts_the_job_which_resumes_to_the_uninterrupted_weights(corpus, tmp_path,
                                                                                          tmp_path_factory):
    """`torchrun --max-restarts 1` on 2 ranks (`--mesh ici=2`), one command line for every attempt
    (`--resume auto`, checkpoints at steps 4 and 8): rank 1 is SIGKILLed after step 6. torchrun ends
    the other rank and starts both again; they resume from step_000004 on their own (the run directory's
    locks and the watchdog are per process: a dead one holds nothing) and finish. Every logged loss of
    both attempts (steps 5 and 6 twice) and every tensor of the final checkpoint (weights, both AdamW
    moments, step, RNG) equal the uninterrupted run's, bit for bit."""
    common = [*_dp_args("llama3_debug", corpus), "--mesh", "ici=2"]
    part = str(tmp_path / "part")
    job = subprocess.Popen([*TORCHRUN, "--standalone", "--nproc-per-node", "2", "--max-restarts", "1",
                            os.path.join(HERE, "test_all.py"), "child_train_losing_a_rank", "1", "6",
                            *common, "--ckpt-interval", "4", "--resume", "auto", "--out-dir", part],
                           cwd=HERE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                           env={**os.environ, **RESTARTABLE})
    try:
        full = shared_run([*common, "--dp-impl", "simple"], tmp_path_factory, 2)  # (the sharded-resume test's run)
        out, err = job.communicate(timeout=300)
    finally:
        job.kill()
    assert job.returncode == 0, err[-4000:]
    starts = [r for r in _records(part) if r.get("event") == "start"]
    assert [s["resumed_at"] for s in starts] == [0, 4], starts  # the first attempt, then the restart at step 4
    assert "failed (exitcode: -9) local_rank: 1" in err, err[-4000:]  # torchrun saw the kill, and restarted
    want, seen = losses(full), [(r["step"], r["loss"]) for r in _records(part) if "loss" in r]
    assert [s for s, _ in seen] == [1, 2, 3, 4, 5, 6, 5, 6, 7, 8, 9, 10] or \
        [s for s, _ in seen] == [1, 2, 3, 4, 5, 5, 6, 7, 8, 9, 10], seen  # (rank 0 may not log step 6 before the kill)
    assert all(loss == want[step] for step, loss in seen), (want, seen)
    a, b = (_every_tensor(os.path.join(d, "checkpoints", "step_000010")) for d in (full, part))
    assert sorted(a) == sorted(b) and len(a) > 3 * 18, sorted(a)
    for name in a:
        assert torch.equal(a[name], b[name]), name
    assert int(b["/step"]) == 10


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
    assert _main([*common, "--resume", "auto"]) == 2
    assert "no good checkpoint remains" in capsys.readouterr().err


def test_max_restarts_with_the_store_shared_with_the_ranks_is_refused_in_one_line(corpus, tmp_path, capsys, monkeypatch):
    """torchrun's default (the c10d rendezvous store shared with the ranks, TORCHELASTIC_USE_AGENT_STORE)
    with --max-restarts: a restart would read the dead attempt's addresses from that store (seen here: the
    restarted rank 0 connects to the killed rank's old port, connection refused, exit 4). Refused at the
    first start, before anything is written, naming the launch that works (the test above uses it)."""
    for key, value in {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1",
                       "MASTER_PORT": "1", "TORCHELASTIC_MAX_RESTARTS": "3", "TORCHELASTIC_USE_AGENT_STORE": "True"}.items():
        monkeypatch.setenv(key, value)
    assert _main([*TINY, "--data", corpus, "--mesh", "ici=2", "--resume", "auto", "--out-dir", str(tmp_path / "r")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: torchrun --max-restarts") and "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1" in err, err
    assert err.count("\n") == 1 and not os.path.exists(tmp_path / "r")
