# run/checkpoint.py + run/rundir.py + train.py: the promises (README). Oracles: the uninterrupted run,
# checksums of the files on disk before and after, real processes (SIGKILL, a file-size limit, SIGSTOP)
"""Part of the suite: collected and run through test_all.py (`pytest test_all.py`)."""
import json
import os
import re
import resource
import subprocess
import sys

import pytest
import torch

from tests import launch
from tests.common import HERE, TINY, _files, _full_params, _main, _trainer, background, losses, run_train


def test_resume_equals_uninterrupted_bit_for_bit(corpus, tmp_path):
    """Also: a garbage `latest` pointer neither hides the checkpoints from a fresh run (refused) nor
    from --resume (newest verified step_N), and the saved RNG state is the uninterrupted run's."""
    from run import checkpoint
    full, part = str(tmp_path / "full"), str(tmp_path / "part")
    common = [*TINY, "--data", corpus, "--steps", "8", "--ckpt-interval", "0"]
    full_run = background(run_train, [*common, "--out-dir", full])
    assert run_train([*common, "--out-dir", part, "--halt-at", "4"])[0] == 0
    assert full_run.result()[0] == 0
    assert not os.path.exists(os.path.join(full, "loss.png"))  # (--no-plot, in TINY)
    assert sorted(losses(part)) == [1, 2, 3, 4]
    with open(os.path.join(part, "checkpoints", "latest"), "wb") as f:
        f.write(b"\xff garbage")
    rc, _, err = run_train([*common, "--out-dir", part])
    assert rc == 2 and "already holds checkpoints" in err and sorted(losses(part)) == [1, 2, 3, 4]
    rc, out, err = run_train([*common, "--out-dir", part, "--resume"])
    assert rc == 0, err
    assert "start at step 4" in out and "resuming from step_000004, which verifies" in err
    assert losses(part) == losses(full)  # exact float equality, steps 1..8
    # Every tensor of the final checkpoints bit-equal: weights, both AdamW moments, step, RNG (the
    # last update shows in no logged loss, only in what is saved).
    import copy
    template = _trainer(corpus, tmp_path).state()

    def flat(state):
        out = {"step": state["step"], "rng": state["rng"], **{f"model/{n}": t for n, t in state["model"].items()}}
        for kind, tensors in state["optim"].items():
            out.update({f"{kind}/{n}": t for n, t in tensors.items()})
        return out
    flat = [flat(checkpoint.load(os.path.join(d, "checkpoints", "step_000008"), copy.deepcopy(template))) for d in (full, part)]
    assert sorted(flat[0]) == sorted(flat[1]) and len(flat[0]) == 3 * len(template["model"]) + 2
    for name, t in flat[0].items():
        assert torch.equal(t, flat[1][name]), name
    assert int(flat[0]["step"]) == 8


BAD_INPUTS = [
    (["--flavor", "gpt5"], "unknown flavor"),
    (["--steps", "0"], "--steps must be positive"),
    (["--batch-size", "-1"], "--batch-size must be positive"),
    (["--seq-len", "4096"], "exceeds the model's max_seq_len"),
    (["--set", "n_kv_heads=4"], "divisible"),
    (["--set", "warp=9"], "expected FIELD=VALUE"),
    (["--data", "/nonexistent/path"], "no such file"),
    (["--device", "cuda"], "no CUDA device"),
    (["--lr", "nan"], "argument --lr: 'nan' is not a finite number"),  # (every float flag: flags.finite_float)
    (["--steps", "ten"], "invalid int value"),
    (["--remat"], "add --mode graph"),
    (["--fsdp-passes", "reshard"], "--fsdp-passes transform(s) the step graph: add --mode graph"),  # (was ignored)
    (["--mode", "graph", "--fsdp-passes", "none"], "--fsdp-passes transform SimpleFSDP's collectives: add --mesh"),
    (["--dp-impl", "fsdp2"], "--dp-impl fsdp2 shards the parameters over --mesh: add --mesh"),  # (was ignored)
    (["--mode", "graph", "--flavor", "qwen3_moe_debug"], "graph mode traces ahead of time; the reference MoE dispatch"),
    (["--mode", "compile", "--scan"], "--scan has no per-block modules"),
    (["--scan", "--flavor", "qwen3_moe_debug"], "--scan traces ahead of time; the reference MoE dispatch reads group sizes on the host (data-dependent shapes): add --kernels pallas"),
    (["--set", "vocab_size=10"], "smaller than the data's 256 byte values"),  # (was an IndexError at step 1)
    (["--set", "attn_impl=foo"], "unknown attention implementation 'foo'"),
    (["--set", "norm_eps=-1"], "norm_eps must be a positive number"),  # (was a NaN loss, exit 3)
    (["--set", "rope_theta=0"], "rope_theta must be a positive number"),
    (["--set", "head_dim=0"], "head_dim must be positive and even for rotary embeddings (none: dim // n_heads), got 0"),  # (was the default)
    (["--flavor", "qwen3_moe_debug", "--set", "moe_groups=0"], "moe_groups must be >= 1, got 0"),
    (["--seed", "-1"], "--seed must be >= 0"),
    (["--flavor", "llama3_405b"], "GiB is free here"),  # refused before the 1.6 TB of weights are allocated
    (["--allow-change", "lr,colour"], "unknown ['colour']"),
    (["--resume-from", "step_000001"], "no such checkpoint"),
    (["--watchdog", "-1"], "--watchdog must be >= 0"),
    (["--steps", "4", "--halt-at", "9"], "--halt-at 9 is past --steps 4: the run would end first"),
    (["--init-from", "/nonexistent"], "config.json: missing or unreadable"),
    (["--flavor", "qwen3_debug", "--init-from", "hf_dir"], "--flavor qwen3_debug and --init-from both name the model"),  # (was: the flavor ignored)
    (["--batch-size", "100000"], "and the activations of 100000 sequences need"),  # (the dry run's estimate)
    (["--scan", "--mesh", "ici=2,tp=2"], "--scan with tp is not built"),  # (checked before any launch)
    (["--task", "flux", "--mesh", "ici=1,tp=2"], "the flux workload's model splits over data-parallel dims (dcn / ici) only, not tp"),
    (["--task", "flux", "--seq-len", "64"], "--task flux's is its image's latent tokens (--image-size): drop --seq-len"),
    (["--task", "flux", "--image-size", "16"], "the digits are 8 x 8"),  # (other sizes: the dry run only)
    (["--task", "flux", "--flavor", "flux_dev", "--data", ""], "(the published flavors: --dry-run)"),  # (on the digits)
]

@pytest.mark.parametrize("args,message", BAD_INPUTS)
def test_bad_input_one_line_exit_2_nothing_written(args, message, corpus, tmp_path, capsys):
    import train
    out_dir = str(tmp_path / "run")
    argv = ["--data", corpus, "--out-dir", out_dir, *args]
    try:
        rc = train.main(argv)
    except SystemExit as exit_:  # argparse type errors exit from inside parse_args
        rc = exit_.code
    err = capsys.readouterr().err.strip()
    assert rc == 2 and err.startswith("error:") and message in err and len(err.splitlines()) == 1, err
    assert not os.path.exists(out_dir)


def test_bad_input_in_a_real_process_has_no_traceback(tmp_path):
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    rc, out, err = run_train(["--data", str(empty), "--out-dir", str(tmp_path / "r")])
    assert rc == 2 and err.strip().splitlines() == [f"error: --data {empty}: no text found (empty, or only binary files)"]


def test_set_parses_each_field_by_its_declared_type():
    import train
    parse = lambda *sets: train.model_args(train.parse_config([x for s in sets for x in ("--set", s)]))
    args = parse("rope_scaling=8,1,4,8192", "head_dim=none", "qk_norm=true", "norm_eps=1e-6", "n_layers=3")
    assert args.rope_scaling == (8, 1, 4, 8192) and args.head_dim is None and args.qk_norm is True
    assert args.norm_eps == 1e-6 and args.n_layers == 3
    assert parse("head_dim=16").head_dim == 16  # Optional[int]: an int, not a string
    for bad, message in [("qk_norm=maybe", "is not a bool (true/false/1/0)"), ("n_layers=2.5", "is not an int"),
                         ("head_dim=x", "is not an int or none"),
                         ("rope_scaling=8,1", "rope_scaling is (factor, low_freq_factor")]:
        with pytest.raises(train.ConfigError, match=re.escape(message)):
            parse(bad)


def test_checkpoint_of_another_flavor_is_refused_and_kept(corpus, tmp_path, capsys):
    out_dir = str(tmp_path / "run")
    assert _main([*TINY, "--data", corpus, "--steps", "2", "--out-dir", out_dir]) == 0
    ckpt = os.path.join(out_dir, "checkpoints", "step_000002")
    before = sorted(os.listdir(ckpt))
    capsys.readouterr()
    rc = _main([*TINY, "--flavor", "qwen3_debug", "--data", corpus, "--steps", "4", "--out-dir", out_dir, "--resume"])
    err = capsys.readouterr().err
    assert rc == 2 and "from another model" in err and len(err.strip().splitlines()) == 1, err
    assert sorted(os.listdir(ckpt)) == before and not os.path.exists(os.path.join(out_dir, "checkpoints", "step_000004"))
    rc = _main([*TINY, "--data", corpus, "--steps", "4", "--out-dir", out_dir])
    assert rc == 2 and "--resume" in capsys.readouterr().err  # a fresh run refuses to overwrite existing checkpoints
    rc = _main([*TINY, "--data", corpus, "--steps", "4", "--out-dir", out_dir, "--resume", "--scan"])
    assert rc == 2 and capsys.readouterr().err.strip().endswith("resume without --scan")  # stacked names differ


@pytest.mark.parametrize("what,value", [("loss", float("nan")), ("grad norm", float("inf"))])
def test_nonfinite_loss_stops_and_keeps_last_good_checkpoint(what, value, corpus, tmp_path, monkeypatch, capsys):
    import train
    out_dir = str(tmp_path / "run")
    real_step = train.Trainer.eager_step

    def poisoned(self, inputs, targets, lr):
        ce, norm = real_step(self, inputs, targets, lr)
        if self.step == 5:
            ce, norm = (ce * value, norm) if what == "loss" else (ce, norm * value)
        return ce, norm

    monkeypatch.setattr(train.Trainer, "eager_step", poisoned)
    rc = train.main([*TINY, "--data", corpus, "--steps", "8", "--ckpt-interval", "3", "--out-dir", out_dir])
    assert rc == 3 and f"error: {what} is {value} at step 5" in capsys.readouterr().err
    ckpts = os.path.join(out_dir, "checkpoints")
    assert sorted(os.listdir(ckpts)) == ["latest", "step_000003"]
    from run import resume
    assert resume.find_resumable(ckpts)[0].endswith("step_000003")


def test_an_out_dir_that_is_a_file_or_unwritable_is_refused(corpus, tmp_path, capsys):
    """README: an --out-dir that is a file, lies under a file, or under a folder this user cannot
    write, or holds a file where the run writes its checkpoints or its --profile traces: one line, exit
    2, the file untouched, nothing written. (/proc/sys is read-only even for root.)"""
    afile = tmp_path / "notes.txt"
    afile.write_text("keep me")
    for out, message in [(str(afile), "exists and is not a directory"), (str(afile / "run"), "is a file, not a directory"),
                         ("/proc/sys/minititan-run", "/proc/sys is not writable")]:
        assert _main([*TINY, "--data", corpus, "--steps", "1", "--out-dir", out]) == 2, out
        err = capsys.readouterr().err.strip()
        assert err.startswith("error: --out-dir ") and message in err and len(err.splitlines()) == 1, err
    assert afile.read_text() == "keep me" and sorted(os.listdir(tmp_path)) == ["notes.txt"]
    for folder, extra in (("checkpoints", []), ("profile", ["--profile", "1"])):  # a file in the way, inside the run
        run = tmp_path / f"with_{folder}"
        run.mkdir()
        (run / folder).write_text("keep me")
        assert _main([*TINY, "--data", corpus, "--steps", "1", "--out-dir", str(run), *extra]) == 2, folder
        err = capsys.readouterr().err.strip()
        assert err == f"error: --out-dir {run}: {run / folder} is a file where the run writes its {folder} folder", err
        assert sorted(os.listdir(run)) == [folder] and (run / folder).read_text() == "keep me"  # (refused before step 1)


@pytest.mark.fast
def test_checkpoint_write_protocol_survives_a_crash_at_every_step(tmp_path, monkeypatch):
    """Fault injection at each write step in turn: the DCP write, the checksums, meta.json, the
    rename, the `latest` pointer. After each crash `latest` names a complete checkpoint and the
    resumable one holds exactly what its step saved (a crash before the rename: the previous one)."""
    from run import checkpoint
    from run import resume
    ckpt_dir = str(tmp_path / "ck")
    checkpoint.save(ckpt_dir, 1, {"w": torch.full((4,), 1.0)}, {"flavor": "x"})
    committed = 1

    def crash(*args, **kwargs):
        raise OSError(28, "No space left on device")

    for step, name in enumerate(["write_shards", "sha256_of", "_write_meta", "_commit", "point_latest"], start=2):
        with monkeypatch.context() as m:
            m.setattr(checkpoint, name, crash)
            with pytest.raises(OSError):
                checkpoint.save(ckpt_dir, step, {"w": torch.full((4,), float(step))}, {"flavor": "x"})
        if name == "point_latest":  # renamed, so complete: only the pointer is behind
            committed = step
        pointer = open(os.path.join(ckpt_dir, "latest")).read()
        assert checkpoint.verify(os.path.join(ckpt_dir, pointer)) is None, name
        path, _ = resume.find_resumable(ckpt_dir)
        assert path.endswith(f"step_{committed:06d}") and checkpoint.verify(path) is None, name
        restored = checkpoint.load(path, {"w": torch.zeros(4)})["w"]
        assert torch.equal(restored, torch.full((4,), float(committed))), name
        if name in ("write_shards", "sha256_of", "_write_meta"):  # failed writes clean up after themselves
            assert not [f for f in os.listdir(ckpt_dir) if f.endswith(".tmp")], name


def test_a_second_run_on_the_same_directory_is_refused_and_a_dead_holder_leaves_no_lock(corpus, tmp_path, capsys):
    out = str(tmp_path / "run")
    holder = subprocess.Popen([sys.executable, "-c", "import sys, time; from run import rundir; rundir.RunDir(sys.argv[1]).open(); "
                               "print('locked', flush=True); time.sleep(300)", out], cwd=HERE, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "locked"
        rc = _main([*TINY, "--data", corpus, "--steps", "2", "--out-dir", out])
        err = capsys.readouterr().err.strip()
        assert rc == 2 and err.startswith("error:") and f"is in use by another run (pid {holder.pid}" in err
        assert sorted(os.listdir(out)) == [".lock.rank0"]  # nothing written
    finally:
        holder.kill()
        holder.wait()
    assert _main([*TINY, "--data", corpus, "--steps", "2", "--out-dir", out]) == 0  # the kernel dropped its lock


def test_nonfinite_values_are_never_saved_and_metrics_stay_strict_json(corpus, tmp_path, monkeypatch, capsys):
    import train
    out = str(tmp_path / "lr")  # lr 1e6: the gradient norm turns NaN while the loss is still finite
    rc = _main([*TINY, "--data", corpus, "--steps", "6", "--lr", "1e6", "--ckpt-interval", "1", "--out-dir", out])
    err = capsys.readouterr().err
    assert rc == 3 and ("error: grad norm is nan" in err or "error: loss is nan" in err), err
    saved = [d for d in os.listdir(os.path.join(out, "checkpoints")) if d.startswith("step_")]
    assert saved
    for name in saved:
        state = _full_params(os.path.join(out, "checkpoints"), [*TINY, "--data", corpus], name)
        assert all(torch.isfinite(t).all() for t in state.values()), name
    for line in open(os.path.join(out, "metrics.jsonl")):
        json.loads(line, parse_constant=lambda c: pytest.fail(f"non-JSON constant {c} in metrics.jsonl"))
    # A NaN validation loss at the last step: exit 3 before the final checkpoint is written.
    monkeypatch.setattr(train.Trainer, "evaluate", lambda self: float("nan") if self.step else 1.0)
    out = str(tmp_path / "val")
    assert _main([*TINY, "--data", corpus, "--steps", "2", "--ckpt-interval", "0", "--out-dir", out]) == 3
    assert "error: val loss is nan at step 2" in capsys.readouterr().err
    assert not os.path.exists(os.path.join(out, "checkpoints"))


def test_resume_refuses_a_changed_config_and_says_what_it_does(corpus, tmp_path, capsys):
    out = str(tmp_path / "run")
    common = [*TINY, "--data", corpus, "--steps", "6", "--ckpt-interval", "3", "--out-dir", out]
    assert _main([*common, "--halt-at", "3"]) == 0
    before = _files(out)
    capsys.readouterr()
    other = tmp_path / "other.txt"
    other.write_text(open(corpus).read()[::-1])
    for extra, message in [(["--lr", "0.01"], "lr: saved 0.003, now 0.01); pass --allow-change lr"),
                           (["--data", str(other)], "data: saved"), (["--seed", "1"], "seed: saved 0, now 1"),
                           (["--steps", "3"], "is at step 3, --steps is 3: nothing to train"),
                           (["--batch-size", "8"], "batch_size: saved 4, now 8"), (["--seq-len", "16"], "seq_len: saved 32, now 16"),
                           (["--warmup", "3"], "warmup: saved 2, now 3"), (["--clip", "0.5"], "clip: saved 1.0, now 0.5"),
                           (["--weight-decay", "0"], "weight_decay: saved 0.1, now 0.0"),
                           (["--dtype", "bf16"], "dtype: saved 'fp32', now 'bf16'")]:
        assert _main([*common, "--resume", *extra]) == 2, extra
        err = capsys.readouterr().err.strip()
        assert err.startswith("error:") and message in err and len(err.splitlines()) == 1, err
    assert _files(out) == before and sorted(losses(out)) == [1, 2, 3]
    os.remove(os.path.join(out, "checkpoints", "latest"))  # a missing pointer: said, and the directory trusted
    assert _main([*common, "--resume", "--lr", "0.01", "--allow-change", "lr"]) == 0  # deliberate
    assert "note: " in (err := capsys.readouterr().err) and "latest is missing or does not name the newest checkpoint; " \
        "resuming from step_000003, which verifies" in err, err
    assert sorted(losses(out)) == [1, 2, 3, 4, 5, 6]
    assert _main([*common[:-1], str(tmp_path / "empty"), "--resume", "--steps", "1"]) == 0
    assert "note: no checkpoint in" in capsys.readouterr().err


def _corrupt_truncate(d):
    f = next(os.path.join(d, n) for n in os.listdir(d) if n.endswith(".distcp"))
    os.truncate(f, os.path.getsize(f) // 2)


def _corrupt_metadata(d):
    with open(os.path.join(d, ".metadata"), "r+b") as f:
        f.seek(40)
        f.write(os.urandom(16))


@pytest.mark.parametrize("corrupt,names", [(_corrupt_truncate, ".distcp does not match its checksum"),
                                           (_corrupt_metadata, ".metadata does not match its checksum"),
                                           (lambda d: os.remove(os.path.join(d, "meta.json")), "meta.json is missing"),
                                           (lambda d: open(os.path.join(d, "meta.json"), "w").write("{"), "meta.json is missing or unreadable")])
def test_a_corrupt_checkpoint_is_named_and_the_good_one_resumes(corrupt, names, corpus, tmp_path, capsys):
    full = str(tmp_path / "full")
    common = [*TINY, "--data", corpus, "--steps", "6", "--ckpt-interval", "3", "--eval-batches", "0"]
    assert _main([*common, "--out-dir", full]) == 0
    corrupt(os.path.join(full, "checkpoints", "step_000006"))
    capsys.readouterr()
    assert _main([*common, "--out-dir", full, "--resume"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and names in err and "pass --resume-from step_000003" in err, err
    want = losses(full)
    os.remove(os.path.join(full, "metrics.jsonl"))
    assert _main([*common, "--out-dir", full, "--resume-from", "step_000003"]) == 0
    assert losses(full) == {s: want[s] for s in (4, 5, 6)}  # the good checkpoint, bit for bit
    assert os.path.isdir(os.path.join(full, "checkpoints", "step_000006.superseded"))  # kept, not resumed


def test_small_data_says_validation_is_skipped(tmp_path, capsys):
    tiny = tmp_path / "tiny.txt"
    tiny.write_bytes(b"All work and no play makes a dull model. " * 3)
    assert _main([*TINY, "--data", str(tiny), "--steps", "1", "--out-dir", str(tmp_path / "r")]) == 0
    assert "note: validation skipped: the validation split has 7 tokens" in capsys.readouterr().err


def test_disk_full_during_a_checkpoint_removes_the_partial_one_and_keeps_the_last(corpus, tmp_path):
    from run import resume
    out = str(tmp_path / "run")
    common = [*TINY, "--data", corpus, "--steps", "6", "--ckpt-interval", "3", "--out-dir", out]
    assert run_train([*common, "--halt-at", "3"])[0] == 0
    before = _files(out)
    # A file-size limit of 256 KiB (smaller than one checkpoint) stands in for a full disk.
    rc, _, err = launch.python(["train.py", *common, "--resume"], limits={resource.RLIMIT_FSIZE: 256 * 1024})
    err = err.strip()
    assert rc == 5 and len(err.splitlines()) == 1, err
    assert err.startswith("error: a write failed: writing checkpoint step_000006 failed") and "step_000003 is kept" in err
    assert _files(out) == before  # no step_000006.tmp left behind, step_000003 untouched
    assert resume.find_resumable(os.path.join(out, "checkpoints"))[0].endswith("step_000003")
    assert run_train([*common, "--resume"])[0] == 0 and sorted(losses(out))[-1] == 6


@pytest.mark.parametrize("sig, code", [("SIGTERM", 143), ("SIGINT", 130)])
def test_a_signal_during_a_checkpoint_removes_it_and_exits_like_a_shell(sig, code, corpus, tmp_path, monkeypatch, capsys,
                                                                       ctrl_c_as_in_a_terminal):
    """SIGTERM / SIGINT arriving while checkpoint step 4 is being written: one line naming the
    signal and the checkpoint kept, exit 128 + signal number (as a shell reports it), no partial
    step_4 left, and the run resumes from step 2 to the uninterrupted losses."""
    import signal
    from run import checkpoint
    out = str(tmp_path / "run")
    common = [*TINY, "--data", corpus, "--steps", "6", "--ckpt-interval", "2", "--eval-batches", "0",
              "--sample-tokens", "0", "--out-dir", out]
    real = checkpoint.write_shards

    def write_then_signal(tmp, state, planner=None):
        real(tmp, state, planner)
        if tmp.endswith("step_000004.tmp"):
            os.kill(os.getpid(), getattr(signal, sig))  # delivered here, mid-save (before the rename)
    monkeypatch.setattr(checkpoint, "write_shards", write_then_signal)
    assert _main(common) == code
    err = capsys.readouterr().err.strip()
    assert err == f"error: interrupted by {sig} at step 4; checkpoint step_000002 is kept (a partial one is removed)", err
    assert sorted(os.listdir(os.path.join(out, "checkpoints"))) == ["latest", "step_000002"]
    monkeypatch.setattr(checkpoint, "write_shards", real)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    assert _main([*common, "--resume"]) == 0
    assert _main([*common, "--out-dir", out + "_full"]) == 0
    assert losses(out) == losses(out + "_full")


def test_own_failures_and_peer_failures_are_told_apart(corpus, tmp_path, monkeypatch, capsys):
    """An out-of-memory error names itself and the intact checkpoint (exit 1), not a peer; a peer's
    connection dropping while a checkpoint is written (DCP wraps it) is a peer failure (exit 4), not
    a failed write (exit 5); a cut last line in metrics.jsonl (a crash mid-write) does not stop a
    --resume; a loss.png that cannot be written is named."""
    from run import checkpoint
    from workloads import lm as lm_task
    out = str(tmp_path / "run")
    common = [*(a for a in TINY if a != "--no-plot"), "--data", corpus, "--steps", "4", "--ckpt-interval", "2",
              "--eval-batches", "1", "--eval-interval", "2", "--sample-tokens", "0", "--out-dir", out]
    real_loss = lm_task.Pretraining.loss

    def oom_at_step_3(model, batch):  # (training calls run with grad enabled, evaluations without)
        oom_at_step_3.calls += torch.is_grad_enabled()
        if oom_at_step_3.calls == 3:
            raise torch.OutOfMemoryError("CPU out of memory: tried to allocate 64.00 GiB")
        return real_loss(model, batch)
    oom_at_step_3.calls = 0
    monkeypatch.setattr(lm_task.Pretraining, "loss", staticmethod(oom_at_step_3))
    assert _main(common) == 1
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: out of memory at step 3 (CPU out of memory") and "checkpoint step_000002 is intact" in err, err
    monkeypatch.setattr(lm_task.Pretraining, "loss", staticmethod(real_loss))
    with open(os.path.join(out, "metrics.jsonl"), "a") as f:
        f.write('{"step": 3, "lo')  # the crash cut this record
    real_write = checkpoint.write_shards

    def peer_drops(tmp, state, planner=None):
        from torch.distributed.checkpoint.api import CheckpointException, _wrap_exception
        dropped = RuntimeError("[../third_party/gloo/gloo/transport/tcp/pair.cc:534] Connection closed by peer")
        raise CheckpointException("save", {1: _wrap_exception(dropped)})  # (what DCP raises on rank 0)
    monkeypatch.setattr(checkpoint, "write_shards", peer_drops)
    assert _main([*common, "--resume"]) == 4
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: a collective failed at step 4: a peer process died or stalled") and len(err.splitlines()) == 1, err
    assert not os.path.exists(os.path.join(out, "checkpoints", "step_000004.tmp"))
    monkeypatch.setattr(checkpoint, "write_shards", real_write)
    import matplotlib.figure
    monkeypatch.setattr(matplotlib.figure.Figure, "savefig", lambda *a, **k: (_ for _ in ()).throw(OSError(28, "No space left on device")))
    assert _main([*common, "--resume"]) == 5
    err = capsys.readouterr().err.strip()
    assert err == f"error: a write failed: No space left on device: {os.path.join(out, 'loss.png')}", err


def test_the_watchdog_of_one_process_blames_no_peer_and_evaluation_batches_are_progress(corpus, tmp_path):
    """One process has no peer: its watchdog line says the process is stuck (exit 4), and a watchdog under
    10 s its stall to two digits (whole seconds said "1 s" for 0.6, "0 s" for 0.01). Every
    evaluation batch is progress: an evaluation longer than --watchdog in all is not a stall."""
    code = "import time; from run import rundir; rundir.Watchdog(0.5, 0, peers=False); time.sleep(30)"
    rc, _, err = launch.python(["-c", code], timeout=60)
    assert rc == 4 and "the process is stuck or too slow" in err and "peer" not in err
    assert re.search(r"^error: no progress for 0\.\d+ s in ", err, re.M), err  # (a short one's seconds: was "1 s")
    from run import rundir
    beats = []
    monkeypatch_beat = rundir.Watchdog.beat
    try:
        rundir.Watchdog.beat = lambda self, where: beats.append(where) or monkeypatch_beat(self, where)
        assert _main([*TINY, "--data", corpus, "--steps", "1", "--eval-batches", "3", "--sample-tokens", "0",
                      "--out-dir", str(tmp_path / "r")]) == 0
    finally:
        rundir.Watchdog.beat = monkeypatch_beat
    assert [b for b in beats if b.startswith("evaluation batch")] == [f"evaluation batch {i} at step {s}"
                                                                     for s in (0, 1) for i in (1, 2, 3)]
