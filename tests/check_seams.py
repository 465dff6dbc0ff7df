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
    parser, fields = cli.build_parser(), [f for f in dataclasses.fields(cli.TrainConfig) if f.metadata.get("cli", True)]
    helps = {a.dest: a.help for a in parser._actions if a.dest != "help"}
    own = {name for name in task_lib.WORKLOADS for name in
           [f.name for f in dataclasses.fields(task_lib.workload_class(name).Flags)]}
    assert set(helps) == {f.name for f in fields} | own and all(helps.values())
    assert all(name in helps["fsdp_passes"] for name in __import__("fsdp_passes").PASSES)  # (prefetch was missing)
    cfg = cli.parse_config(["--steps", "7", "--lr", "0.5", "--set", "dim=8", "--set", "n_layers=1", "--scan"])
    assert (cfg.steps, cfg.lr, cfg.set, cfg.scan, cfg.init_from) == (7, 0.5, ["dim=8", "n_layers=1"], True, None)
    assert cli.parse_config([]) == cli.TrainConfig(set=[], flavor="llama3_debug",
                                                   workload_flags=task_lib.workload_class("lm").Flags())
    assert (cfg.sample_tokens, cli.parse_config(["--task", "grpo"]).group_size) == (64, 8)  # a workload's flag


@pytest.mark.parametrize("argv, message", [
    (["--group-size", "1"], "--group-size is a flag of --task grpo, not of --task lm"),
    (["--aggregation", "bogus"], "--aggregation is a flag of --task grpo, not of --task lm"),
    (["--kl-beta", "-1"], "--kl-beta is a flag of --task grpo, not of --task lm"),
    (["--image-size", "999"], "--image-size is a flag of --task flux, not of --task lm"),
    (["--task", "flux", "--group-size", "1"], "--group-size is a flag of --task grpo, not of --task flux"),
    (["--task", "sft", "--data", "/nonexistent"], "--data is a flag of --task lm, flux, not of --task sft"),
    (["--task", "sft", "--temperature", "2"], "--temperature is a flag of --task grpo, not of --task sft"),
    (["--task", "grpo", "--tokenizer", "x"], "--tokenizer is a flag of --task lm, not of --task grpo"),
    (["--task", "grpo", "--aggregation", "bogus"], "aggregation"),
])
def test_a_flag_of_another_workload_or_a_bad_own_flag_is_one_line_exit_2(argv, message, capsys):
    """Flags that do not apply to the chosen workload are refused (they were ignored in silence)."""
    import train
    assert train.main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: ") and message in err, err


def _imports(path):
    """Every module a file imports (top level and inside functions), as dotted names."""
    import ast
    names = set()
    for node in ast.walk(ast.parse(open(path).read())):
        if isinstance(node, ast.Import):
            names |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0:
            names |= {node.module} | {f"{node.module}.{a.name}" for a in node.names}
    return names


def test_the_layers_import_downwards_only():
    """task.py and parallel.py import nothing of ours but the lowest layer (errors, device); cli.py and
    train.py import no workload (they reach one through task.WORKLOADS); no import cycle among our
    modules, function-level imports included."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    ours = {}
    for d in ("", "flux", "rl", "planner"):
        for f in os.listdir(os.path.join(root, d)):
            if f.endswith(".py") and not f.startswith("test") and f != "__init__.py":
                ours[(d + "." if d else "") + f[:-3]] = os.path.join(root, d, f)
    graph = {m: {n for n in _imports(p) if n in ours} for m, p in ours.items()}
    assert graph["task"] == set() and graph["errors"] == set()
    assert graph["parallel"] <= {"device", "errors"}, graph["parallel"]
    workload_modules = {m for m in ours if m.startswith(("flux.", "rl.")) or m == "lm_task"}
    assert not graph["cli"] & workload_modules and not graph["train"] & workload_modules
    # The layout is the family's (ModelFamily.layout_args / split): no layout file imports a model's
    # module or its parallel plans, nor names a class of one (a model class or config)
    import ast
    model_modules = {"model", "tensor_parallel", "expert_parallel"} | workload_modules
    model_classes = {n.name for m in model_modules for n in ast.walk(ast.parse(open(ours[m]).read()))
                     if isinstance(n, ast.ClassDef)}
    assert {"ModelArgs", "Transformer", "MoE", "FluxArgs", "Flux"} <= model_classes
    for layout in ("mesh", "spmd", "parallel", "simplefsdp"):
        assert not graph[layout] & model_modules, (layout, graph[layout] & model_modules)
        tree = ast.parse(open(ours[layout]).read())
        named = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)} | \
                {n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute)}
        assert not named & model_classes, (layout, named & model_classes)
    state = {}

    def visit(m, path):  # depth-first: a module met again on the current path is a cycle
        state[m] = "open"
        for n in sorted(graph[m]):
            assert state.get(n) != "open", f"import cycle: {' -> '.join(path + [m, n])}"
            if n not in state:
                visit(n, path + [m])
        state[m] = "done"
    for m in sorted(graph):
        if m not in state:
            visit(m, [])


class Line(task_lib.ModelFamily):
    """nn.Linear(4, 1): a matrix (decayed) and a bias (not)."""

    def build(self, args):
        return torch.nn.Linear(*args)

    def label(self):
        return "line"

    def record(self, args):
        return list(args)


class LinearRegression(task_lib.Workload):
    """A workload the trainer was not written for, against the two interfaces: the whole of it."""
    name, default_flavor, family_class = "linreg", "line", Line

    def __init__(self, cfg):
        super().__init__(cfg)
        self.family = Line((4, 1))

    def setup_data(self, dp_rank, dp_size):
        self.val_batches = [self.batch(10**6)]

    def batch(self, step):  # a pure function of (seed, step)
        x = torch.randn(self.cfg.batch_size, 4, generator=torch.Generator().manual_seed(self.cfg.seed * 7919 + step))
        return x, x @ torch.tensor([[1.0], [-2.0], [3.0], [0.5]]) + 0.25

    def loss(self, model, batch):
        mse = F.mse_loss(model(batch[0]), batch[1])
        return mse, mse

    units_per_step = property(lambda self: self.cfg.batch_size)
    flops_per_step = lambda self, args: 6 * 5 * self.cfg.batch_size


@pytest.mark.parametrize("mode", ["eager", "graph"])
def test_a_new_workload_trains_through_the_task_interface_like_a_plain_loop(mode, tmp_path, monkeypatch):
    """The shared loop (schedule, clipping, AdamW with its decay mask, checkpoints, metrics) on a
    regression task of ~20 lines: losses equal a plain PyTorch loop with torch.optim.AdamW; eager and
    graph mode alike; it checkpoints, and validation runs through the task."""
    import train
    out = str(tmp_path / "run")
    # one registry line makes it a --task (as a new workload's file would be named in task.WORKLOADS)
    monkeypatch.setitem(task_lib.WORKLOADS, "linreg", "tests.check_seams:LinearRegression")
    cfg = train.parse_config(["--task", "linreg", "--steps", "12", "--batch-size", "8", "--lr", "0.05", "--warmup", "3",
                              "--clip", "0.5", "--mode", mode, "--eval-interval", "6", "--ckpt-interval", "6",
                              "--log-interval", "1", "--out-dir", out])
    tr = train.Trainer(cfg)
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
