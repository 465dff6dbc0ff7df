# cli.py + task.py + train.py: the seams. Oracles: the dataclass's own fields, a plain PyTorch loop
# with torch.optim.AdamW and clip_grad_norm_ on a workload the trainer has never seen
"""Part of the suite: collected and run through test_all.py (`pytest test_all.py`)."""
import dataclasses
import math
import os

import torch.nn.functional as F
import pytest
import torch

import task as task_lib

from tests.common import _records, losses


def test_every_config_field_is_a_flag_with_its_type_and_help():
    import cli
    parser, fields = cli.build_parser(), dataclasses.fields(cli.TrainConfig)
    helps = {a.dest: a.help for a in parser._actions if a.dest != "help"}
    assert set(helps) == {f.name for f in fields} and all(helps.values())
    assert all(name in helps["fsdp_passes"] for name in __import__("fsdp_passes").PASSES)  # (prefetch was missing)
    cfg = cli.parse_config(["--steps", "7", "--lr", "0.5", "--set", "dim=8", "--set", "n_layers=1", "--scan"])
    assert (cfg.steps, cfg.lr, cfg.set, cfg.scan, cfg.init_from) == (7, 0.5, ["dim=8", "n_layers=1"], True, None)
    assert isinstance(cfg, cli.TrainConfig) and cli.parse_config([]) == cli.TrainConfig(set=[], flavor="llama3_debug")


class LinearRegression(task_lib.Task):
    """A workload the trainer was not written for, against the Task interface: the whole of it."""

    def __init__(self, cfg):
        super().__init__(cfg)
        self.args = (4, 1)  # nn.Linear(4, 1): a matrix (decayed) and a bias (not)

    def setup_data(self, dp_rank, dp_size):
        self.val_batches = [self.batch(10**6)]

    def build_model(self, args):
        return torch.nn.Linear(*args)

    def batch(self, step):  # a pure function of (seed, step)
        x = torch.randn(self.cfg.batch_size, 4, generator=torch.Generator().manual_seed(self.cfg.seed * 7919 + step))
        return x, x @ torch.tensor([[1.0], [-2.0], [3.0], [0.5]]) + 0.25

    def loss(self, model, batch):
        mse = F.mse_loss(model(batch[0]), batch[1])
        return mse, mse

    units_per_step = property(lambda self: self.cfg.batch_size)
    flops_per_step = lambda self, args: 6 * 5 * self.cfg.batch_size


@pytest.mark.parametrize("mode", ["eager", "graph"])
def test_a_new_workload_trains_through_the_task_interface_like_a_plain_loop(mode, tmp_path):
    """The shared loop (schedule, clipping, AdamW with its decay mask, checkpoints, metrics) on a
    regression task of ~20 lines: losses equal a plain PyTorch loop with torch.optim.AdamW; eager and
    graph mode alike; it checkpoints, and validation runs through the task."""
    import train
    out = str(tmp_path / "run")
    cfg = train.parse_config(["--steps", "12", "--batch-size", "8", "--lr", "0.05", "--warmup", "3", "--clip", "0.5",
                              "--mode", mode, "--eval-interval", "6", "--ckpt-interval", "6", "--log-interval", "1",
                              "--out-dir", out])
    tr = train.Trainer(cfg, task=LinearRegression(cfg))
    assert tr.run() == 0
    task = tr.task
    torch.manual_seed(cfg.seed)  # the trainer seeds, then builds: the same initial weights
    ref = torch.nn.Linear(4, 1)
    opt = torch.optim.AdamW([{"params": [ref.weight], "weight_decay": cfg.weight_decay},
                             {"params": [ref.bias], "weight_decay": 0.0}], lr=cfg.lr, betas=(0.9, 0.95), eps=1e-8)
    expected = {}
    for step in range(1, cfg.steps + 1):
        lr = cfg.lr * step / cfg.warmup if step <= cfg.warmup else cfg.lr * (
            0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * (step - cfg.warmup) / (cfg.steps - cfg.warmup))))
        for group in opt.param_groups:
            group["lr"] = lr
        x, y = task.batch(step)
        loss = F.mse_loss(ref(x), y)
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(ref.parameters(), cfg.clip)
        opt.step()
        expected[step] = loss.item()
    got = losses(out)
    assert got.keys() == expected.keys()
    torch.testing.assert_close(torch.tensor([got[k] for k in sorted(got)]), torch.tensor([expected[k] for k in sorted(expected)]),
                               rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(tr.model.weight.detach(), ref.weight.detach(), rtol=1e-5, atol=1e-6)
    assert sorted(_records(out, "val_loss")) == [0, 6, 12]
    assert sorted(os.listdir(os.path.join(out, "checkpoints"))) == ["latest", "step_000006", "step_000012"]
