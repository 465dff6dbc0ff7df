# Bad input found before anything runs (a hostile pass over every input). Oracles: the refusal itself (one
# `error:` line, exit 2, no run directory), and for a suggested remedy, that doing what it says works.
"""Part of the suite: collected and run through test_all.py (`pytest test_all.py`)."""
import math
import os
import re

import pytest

from tests.common import TINY, _main, run_train


GRPO_TINY = ["--task", "grpo", *TINY[:10], "--set", "head_dim=32", "--set", "max_seq_len=16"]

NONFINITE_OR_OUT_OF_RANGE = [  # each ran on (or was a traceback) before: the issue's item in brackets
    (["--task", "grpo", "--temperature", "nan"], "argument --temperature: 'nan' is not a finite number"),  # (2)
    (["--task", "grpo", "--kl-beta", "nan"], "argument --kl-beta: 'nan' is not a finite number"),  # (2)
    (["--task", "grpo", "--clip-eps", "nan"], "argument --clip-eps: 'nan' is not a finite number"),  # (10)
    (["--task", "sft", "--format-credit", "inf"], "argument --format-credit: 'inf' is not a finite number"),
    (["--flavor", "qwen3_moe_debug", "--set", "aux_loss_coef=nan"], "'aux_loss_coef=nan': not a finite number"),  # (10)
    (["--set", "rope_scaling=0.0,1.0,4.0,8192"], "factor > 0, 0 < low < high"),  # (10: a division by 0)
    (["--set", "rope_scaling=8,4,4,8192"], "factor > 0, 0 < low < high"),
    (["--set", "rope_scaling=8,nan,4,8192"], "'rope_scaling=8,nan,4,8192': not a finite number"),
    (["--set", "head_dim=-2"], "head_dim must be positive and even"),  # (4: a traceback, exit 1)
    (["--task", "sft", "--seq-len", "64"], "--seq-len sets --task lm's row length; --task sft's is a problem's"),  # (ignored)
]


@pytest.mark.parametrize("args,message", NONFINITE_OR_OUT_OF_RANGE)
def test_nonfinite_flags_and_config_values_are_one_line_exit_2_nothing_written(args, message, tmp_path, capsys):
    out_dir = str(tmp_path / "run")
    rc = _main([*args, "--out-dir", out_dir, "--steps", "2"])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and err.startswith("error:") and message in err and len(err.splitlines()) == 1, err
    assert not os.path.exists(out_dir)


@pytest.mark.parametrize("count", ["abc", "0", ""])
def test_a_bad_xla_cpu_device_count_is_one_line_not_torch_xlas_crash(count, tmp_path, monkeypatch, capsys):
    """CPU_NUM_DEVICES is read by torch_xla as XLA:CPU starts: 'abc' was a segmentation fault (exit 139),
    '0' and '' no device at all. Refused before torch_xla starts (device.default_to_xla_cpu)."""
    monkeypatch.setenv("CPU_NUM_DEVICES", count)
    monkeypatch.setenv("PJRT_DEVICE", "CPU")  # (restored after: default_to_xla_cpu sets it)
    assert _main(["--device", "xla", "--steps", "1", "--out-dir", str(tmp_path / "r")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"error: CPU_NUM_DEVICES={count!r}: XLA:CPU's device count is a positive integer"], err
    assert not os.path.exists(tmp_path / "r")


def test_a_pjrt_runtime_that_cannot_start_here_is_one_line_exit_2(tmp_path):
    """PJRT_DEVICE=TPU on a machine without libtpu (the auto device, and XLA SPMD's mesh) was "a write
    failed: libtpu not found", exit 5 (torch_xla's OSError read as a failed write); PJRT_DEVICE=bogus a
    traceback, exit 1. In real processes: torch_xla's runtime cannot start twice in one."""
    for pjrt, extra, why in (("TPU", [], "libtpu not found"),
                             ("bogus", ["--device", "xla", "--mesh", "ici=2"], "No PjRtPlugin registered for: bogus")):
        rc, _, err = run_train(["--steps", "1", "--out-dir", str(tmp_path / "r"), *extra], {"PJRT_DEVICE": pjrt})
        assert rc == 2 and err.strip().splitlines()[-1] == f"error: PJRT_DEVICE={pjrt}: torch_xla cannot start that " \
            f"runtime here ({why})", err[-2000:]
    assert not os.path.exists(tmp_path / "r")


@pytest.mark.fast
def test_the_checks_refuse_nan_wherever_the_value_comes_from():
    """A config.json or a checkpoint's record reaches model.check_args without run/cli.py, and GRPO's config
    is built by code too: NaN passed each of these checks (`x < 0` is False for NaN)."""
    from model import ModelArgs, check_args
    from rl.grpo import GRPOConfig
    for bad in ({"aux_loss_coef": math.nan}, {"norm_eps": math.nan}, {"rope_scaling": (8.0, 1.0, math.nan, 8192)},
                {"head_dim": -2}):
        with pytest.raises(ValueError):
            check_args(ModelArgs(**bad))
    check_args(ModelArgs(rope_scaling=(8.0, 1.0, 4.0, 8192)))  # (Llama 3.1's own passes)
    for bad in ({"temperature": math.nan}, {"beta": math.nan}, {"eps_low": math.nan}, {"eps_high": math.inf}):
        with pytest.raises(ValueError):
            GRPOConfig(**bad).check()


@pytest.mark.parametrize("explicit", [False, True])
def test_the_vllm_head_dim_hint_works_when_followed(explicit):
    """The hint was `--set n_heads=2`, which leaves an explicit head_dim as it was: the
    same error again. Following the hint must give a config the engine takes."""
    from run import cli
    from errors import ConfigError
    from model import check_args
    from rl import vllm_engine
    from tests.common import tiny_args
    args = tiny_args(head_dim=16) if explicit else tiny_args()  # dim 64, 4 heads: 16 either way
    with pytest.raises(ConfigError) as refused:
        vllm_engine.check_model(args)
    hint = re.search(r"--set (\w+=\w+)", str(refused.value)).group(1)
    fixed = cli.with_overrides(args, [hint])
    check_args(fixed)
    vllm_engine.check_model(fixed)


def test_resuming_a_run_of_another_task_names_both_and_the_remedy_works(corpus, tmp_path, capsys):
    """`--task sft --resume` on an lm run was told to pass `--allow-change steps,sft`,
    which run/cli.py then refused as unknown; meta.json records the task, which was never named."""
    out = str(tmp_path / "lm")
    at = TINY.index("--seq-len")  # (an lm flag: sft's rows have their own length)
    base = [*TINY[:at], *TINY[at + 2:], "--eval-batches", "0", "--out-dir", out]
    lm = ["--data", corpus, "--sample-tokens", "0", *TINY[at:at + 2]]
    assert _main([*base, *lm, "--steps", "2"]) == 0
    capsys.readouterr()
    assert _main(["--task", "sft", *base, "--steps", "4", "--resume"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "is from a --task lm run, this run is --task sft" in err, err
    assert "--allow-change" not in err and sorted(os.listdir(os.path.join(out, "checkpoints"))) == ["latest", "step_000002"]
    # the remedy it names: resume with the run's own task (another --out-dir is a fresh run)
    assert _main([*base, *lm, "--steps", "3", "--resume", "--allow-change", "steps"]) == 0
    assert "step_000003" in os.listdir(os.path.join(out, "checkpoints"))


def test_a_refusal_on_a_rank_above_0_waits_silent_for_rank_0_and_then_speaks_named(tmp_path, monkeypatch, capsys):
    """Under torchrun every rank said the same `error:` line. Now a rank > 0 says
    nothing while rank 0 (which runs the same checks) speaks and torchrun stops the others (SIGTERM:
    exit 2, quietly); only if it is still running after the grace period (rank 0 did not refuse) does it
    speak, naming itself. The whole launch: test_mesh_that_does_not_match_world_size_fails_fast."""
    import signal
    from run import process
    monkeypatch.setenv("RANK", "1")
    heard = []
    monkeypatch.setattr(process.time, "sleep", lambda s: heard.append((s, capsys.readouterr().err,
                                                                     signal.getsignal(signal.SIGTERM))))
    before = signal.getsignal(signal.SIGTERM)
    assert _main(["--steps", "0", "--out-dir", str(tmp_path / "r")]) == 2
    (waited, said_meanwhile, on_sigterm), = heard
    assert waited == process.REFUSAL_GRACE_S and said_meanwhile == "" and on_sigterm not in (before, process._raise_interrupted)
    assert capsys.readouterr().err == "error: rank 1: --steps must be positive, got 0\n"
    assert signal.getsignal(signal.SIGTERM) == process._raise_interrupted  # (the grace's handler is undone)


def test_checkpoint_knows_an_interruption_by_its_class_not_its_name():
    """run/checkpoint.py recognised train.Interrupted by its class name (any class called
    `Interrupted`, or a message holding "Interrupted(", passed). It is errors.Interrupted now, found by
    isinstance, also inside the CheckpointException DCP gathers its writers' errors into."""
    import signal
    import traceback
    from torch.distributed.checkpoint.api import CheckpointException
    import errors
    from run import process
    assert process.Interrupted is errors.Interrupted and str(errors.Interrupted(signal.SIGTERM)) == "SIGTERM"
    stop = errors.Interrupted(signal.SIGTERM)
    assert errors.interrupted(stop) and errors.interrupted(KeyboardInterrupt())
    assert errors.interrupted(CheckpointException("save failed", {0: (stop, traceback.StackSummary())}))
    Interrupted = type("Interrupted", (Exception,), {})  # a stranger of the same name: not ours
    assert not errors.interrupted(Interrupted()) and not errors.interrupted(RuntimeError("Interrupted(15)"))
    assert not errors.interrupted(CheckpointException("disk full", {0: (OSError(28, "No space"), traceback.StackSummary())}))
    import pickle  # (DCP moves errors between ranks pickled)
    assert pickle.loads(pickle.dumps(stop)).signum == signal.SIGTERM


def test_a_stop_that_lands_while_a_class_is_created_ends_as_a_stop(monkeypatch, capsys):
    """torchrun's SIGTERM reached a rank > 0 inside a lazy import (a dataclass's field being named):
    Python wraps what a descriptor's __set_name__ raises in its own RuntimeError, so the stop was said
    as `rank 1: failed: RuntimeError: Error calling __set_name__ ...`, a second error line beside rank
    0's refusal. The oracle: Python itself wrapping a real SIGTERM, sent from inside __set_name__."""
    import signal
    from run import process
    class NamedWhenTheSignalLands:
        def __set_name__(self, owner, name):
            os.kill(os.getpid(), signal.SIGTERM)  # (the handler runs here: Interrupted raised inside)

    def body(argv, at):
        type("Created", (), {"field": NamedWhenTheSignalLands()})

    previous = signal.getsignal(signal.SIGTERM)
    try:
        for rank, said in (("1", ""), ("0", "error: interrupted by SIGTERM at step 0; no checkpoint was "
                                            "written (a partial one is removed)\n")):
            monkeypatch.setenv("RANK", rank)
            assert process.run(body) == 128 + signal.SIGTERM
            assert capsys.readouterr().err == said
    finally:
        signal.signal(signal.SIGTERM, previous)


@pytest.mark.fast
def test_graph_mode_flags_are_checked_by_cli_alone(monkeypatch):
    """`--backend xla` on a device that is not XLA and graph mode under FSDP2 are refused by cli.validate
    before any process starts, `--device auto` included (it was refused later, by graph_trainer.py, which
    checked both again); graph_trainer.py checks neither."""
    from run import cli
    monkeypatch.delenv("PJRT_DEVICE", raising=False)
    for argv, message in ((["--mode", "graph", "--backend", "xla"], "--backend xla needs an XLA device"),
                          (["--mode", "graph", "--backend", "xla", "--device", "cpu"], "--backend xla needs an XLA device"),
                          (["--mode", "graph", "--backend", "openxla", "--device", "cpu"], "--backend openxla needs an XLA device"),
                          (["--mode", "graph", "--backend", "openxla", "--device", "xla", "--mesh", "ici=2"],
                           "--backend openxla runs on one XLA device: under --mesh use --backend xla"),
                          (["--mode", "graph", "--mesh", "ici=2", "--dp-impl", "fsdp2"], "FSDP2's hooks do not trace")):
        with pytest.raises(cli.ConfigError, match=re.escape(message)):
            cli.parse_config(argv)
    assert cli.parse_config(["--mode", "graph", "--backend", "xla", "--device", "xla"]).backend == "xla"
    source = open(os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "graph_trainer.py")).read()
    assert "--backend" not in source and "traceable" not in source
