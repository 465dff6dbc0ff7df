# run/cli.py + task.py + train.py: the seams. Oracles: the dataclass's own fields, a plain PyTorch loop
# with torch.optim.AdamW and clip_grad_norm_ on a workload the trainer has never seen
"""Part of the suite: collected and run through test_all.py (`pytest test_all.py`)."""
import dataclasses
import functools
import math
import os

import torch.nn.functional as F
import pytest
import torch

import task as task_lib

from tests.common import _records, losses


def test_every_config_field_is_a_flag_with_its_type_and_help():
    from run import cli
    parser, fields = cli.build_parser(), [f for f in dataclasses.fields(cli.TrainConfig) if f.metadata.get("cli", True)]
    helps = {a.dest: a.help for a in parser._actions if a.dest != "help"}
    own = {name for name in task_lib.WORKLOADS for name in
           [f.name for f in dataclasses.fields(task_lib.workload_class(name).Flags)]}
    assert set(helps) == {f.name for f in fields} | own and all(helps.values())
    assert all(name in helps["fsdp_passes"] for name in __import__("fsdp_passes").PASSES)  # (prefetch was missing)
    cfg = cli.parse_config(["--steps", "7", "--lr", "0.5", "--set", "dim=8", "--set", "n_layers=1", "--scan"])
    assert (cfg.steps, cfg.lr, cfg.set, cfg.scan, cfg.init_from) == (7, 0.5, ["dim=8", "n_layers=1"], True, None)
    lm, grpo = (cli.config_class(task_lib.workload_class(name)) for name in ("lm", "grpo"))
    assert cli.parse_config([]) == lm(set=[], flavor="llama3_debug")
    assert (cfg.sample_tokens, cli.parse_config(["--task", "grpo"]).group_size) == (64, 8)  # a workload's flag
    # each a declared field of the run's config class (TrainConfig.__getattr__ hid where they came from)
    assert "group_size" in {f.name for f in dataclasses.fields(grpo)} and not hasattr(cfg, "group_size")
    assert "__getattr__" not in vars(cli.TrainConfig) and issubclass(grpo, cli.TrainConfig)


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


PACKAGES = ("flux", "rl", "planner", "run", "interop", "tpu_pod", "workloads")  # the product, below the lesson
ENTRY_POINTS = {"train", "generate", "bench", "bench_flux", "bench_rollout"}  # compose the lesson and the product


def _our_modules(root):
    ours = {}
    for d in ("",) + PACKAGES:
        for f in os.listdir(os.path.join(root, d)):
            if f.endswith(".py") and not f.startswith("test") and f not in ("__init__.py", "conftest.py"):
                ours[(d + "." if d else "") + f[:-3]] = os.path.join(root, d, f)
    return ours


@pytest.mark.fast
def test_the_layers_import_downwards_only():
    """task.py and parallel.py import nothing of ours but the lowest layer (errors, device); run/cli.py,
    train.py and planner/ import no workload (they reach one through task.WORKLOADS), and no workload
    imports run/cli.py (a flag is declared with run/flags.py); no import cycle among our modules, function-level
    imports included."""
    ours = _our_modules(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    graph = {m: {n for n in _imports(p) if n in ours} for m, p in ours.items()}
    assert graph["task"] == set() and graph["errors"] == set()
    assert graph["parallel"] <= {"device", "errors"}, graph["parallel"]
    workload_modules = {m for m in ours if m.startswith(("flux.", "rl.")) or m.startswith("workloads.")}
    assert not graph["run.cli"] & workload_modules and not graph["train"] & workload_modules
    # the planner learns a model's shape from its family (ModelFamily.plan), never from a workload module
    planner = {m for m in ours if m.startswith("planner.")}
    assert planner and all(not graph[m] & workload_modules for m in planner), {m: graph[m] & workload_modules for m in planner}
    assert graph["run.flags"] == set() and not any("run.cli" in graph[m] for m in workload_modules)  # (run/flags.py declares them)
    # The layout is the family's (ModelFamily.layout_args / split): no layout file imports a model's
    # module or its parallel plans, nor names a class of one (a model class or config)
    import ast
    model_modules = {"model", "model_args", "tensor_parallel", "expert_parallel"} | workload_modules
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


@pytest.mark.fast
def test_the_lesson_imports_no_product_package():
    """The top level is the lesson (the model, the step, the layouts, the kernels): none of its modules
    imports a package below it (the run's machinery, HF interop, the planner, the TPU pod compile, the
    workloads), at the top or inside a function. Only the entry points (train.py, generate.py, the
    benchmarks) compose both. And the lesson stays a lesson's size: at most 26 modules."""
    ours = _our_modules(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    lesson = {m for m in ours if "." not in m and m not in ENTRY_POINTS}
    crossing = {m: sorted(n for n in _imports(ours[m]) if n.split(".")[0] in PACKAGES) for m in lesson}
    assert not {m: n for m, n in crossing.items() if n}, {m: n for m, n in crossing.items() if n}
    assert 20 <= len(lesson) <= 26, sorted(lesson)


@pytest.mark.fast
def test_atomic_writes_and_the_process_shell_each_have_one_home():
    """Every whole-or-nothing write (a temporary renamed over its target: os.replace), fsync and file
    digest of our modules is atomic.py's; the trainer (train.py) installs no signal handler, catches no
    interruption and ends no process: run/process.py does. Read from each module's own calls and names (ast)."""
    import ast
    ours = _our_modules(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    calls, names = {}, {}
    for m, path in ours.items():
        tree = ast.parse(open(path).read())
        calls[m] = {ast.unparse(n.func) for n in ast.walk(tree) if isinstance(n, ast.Call)}
        names[m] = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)} | \
                   {n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute)}
    hand_rolled = {m: sorted(calls[m] & {"os.replace", "os.fsync", "hashlib.file_digest"}) for m in ours if m != "atomic"}
    assert not {m: c for m, c in hand_rolled.items() if c}, hand_rolled
    shell = {"signal", "Interrupted", "KeyboardInterrupt", "_exit", "exit", "faulthandler"}
    assert not names["train"] & shell, names["train"] & shell
    assert "signal.signal" in calls["run.process"] and "os._exit" in calls["run.process"]




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


@pytest.mark.fast
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


def _read_attributes(path, owner):
    """Names of the attributes a file reads from `self.<owner>` (e.g. the trainer's `self.task.X`)."""
    import ast
    return {node.attr for node in ast.walk(ast.parse(open(path).read()))
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Attribute)
            and node.value.attr == owner and isinstance(node.value.value, ast.Name) and node.value.value.id == "self"}


def test_the_trainer_uses_only_members_the_interfaces_declare():
    """`units_per_step` was used by the trainer but not declared by task.Workload.
    Every member train.py reads of its workload and its family is one task.py declares, and it names
    no workload's flag."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    declared = set(dir(task_lib.Workload)) | set(vars(task_lib.Workload(None)))  # (cfg, family: set in __init__)
    used = _read_attributes(os.path.join(root, "train.py"), "task")
    assert used and used <= declared, used - declared
    used = _read_attributes(os.path.join(root, "train.py"), "family")
    assert used and used <= set(dir(task_lib.ModelFamily)), used - set(dir(task_lib.ModelFamily))
    import ast  # (item 15) nor does it know a workload's settings: it popped the LM's "tokenizer" from meta()
    strings = {n.value for n in ast.walk(ast.parse(open(os.path.join(root, "train.py")).read()))
               if isinstance(n, ast.Constant) and isinstance(n.value, str)}
    flags = {f.name for name in task_lib.WORKLOADS for f in dataclasses.fields(task_lib.workload_class(name).Flags)}
    assert not strings & flags, strings & flags


def test_a_resume_offers_only_changes_cli_accepts_and_grpo_records_what_its_policy_names(tmp_path):
    """A resume's policy is one form (Workload.resume_policy). GRPO records exactly the
    keys its policy names (its key lists were written three times, and disagreed: vllm_python); a
    recorded setting this version does not know (a checkpoint of another version) is refused, not offered
    to --allow-change, which run/cli.py would refuse; what it offers, run/cli.py takes."""
    import functools
    import json
    from run import checkpoint
    from run import cli
    from run import resume
    import train
    cfg = cli.parse_config(["--task", "grpo", "--set", "dim=64", "--set", "n_heads=4", "--set", "n_layers=1"])
    workload = train.make_workload(cfg)
    cls = type(workload)
    assert set(workload.meta()["grpo"]) | {"init_from"} == set(cls.resume_policy)
    assert set(resume.changeable(cls)) == {*resume.RESUME_CHECKED, "mesh", *cls.resume_policy,
                                           *cls.family_class.resume_settings} - {"updates_per_batch"}
    meta = {"task": "grpo", "train": {**{k: getattr(cfg, k) for k in resume.RESUME_CHECKED}, **workload.meta()}}
    saved = json.loads(json.dumps(meta))
    saved["train"]["grpo"].update(colour=1, temperature=0.5)
    os.makedirs(tmp_path / "ckpt")
    (tmp_path / "ckpt" / "meta.json").write_text(json.dumps(saved))
    refusal = functools.partial(resume.refusal_for, cls)
    with pytest.raises(checkpoint.CheckpointError) as refused:
        resume.check_compatible(str(tmp_path / "ckpt"), meta, (), refusal)
    assert "colour: saved 1, now None" in str(refused.value) and "--allow-change" not in str(refused.value)
    del saved["train"]["grpo"]["colour"]
    (tmp_path / "ckpt" / "meta.json").write_text(json.dumps(saved))
    with pytest.raises(checkpoint.CheckpointError, match="pass --allow-change temperature to continue"):
        resume.check_compatible(str(tmp_path / "ckpt"), meta, (), refusal)
    offered = cli.parse_config(["--task", "grpo", "--allow-change", "temperature"]).allow_change.split(",")
    resume.check_compatible(str(tmp_path / "ckpt"), meta, offered, refusal)


def test_ep_buffer_factor_is_a_setting_a_resume_may_change_also_from_a_record_that_kept_it_in_model_args(tmp_path):
    """The buffer factor sizes ep's exchange (which rows a step drops), not a weight: a checkpoint
    records it as a training setting (LanguageModelFamily.resume_settings, with the MoE's aux-loss
    weight and routing groups), which --allow-change may name; a checkpoint whose record kept it
    among model_args (an earlier version) reads it from there, so resuming that run unchanged is not
    "another model"; a run read back from its record has its whole config."""
    import json
    from run import checkpoint
    from run import cli
    from run import resume
    import train
    cfg = cli.parse_config(["--flavor", "qwen3_moe_debug", "--set", "ep_buffer_factor=1.5", "--set", "aux_loss_coef=0.005"])
    workload = train.make_workload(cfg)
    cls = type(workload)
    assert {"ep_buffer_factor", "aux_loss_coef", "moe_groups"} <= set(resume.changeable(cls))
    workload.fingerprint = "corpus"  # (what setup_data would set: this test reads no corpus)
    meta = resume.run_record(cfg, workload, workload.args, "ici=2,ep=2")
    assert "ep_buffer_factor" not in meta["model_args"] and meta["train"]["ep_buffer_factor"] == 1.5
    # what reads a run back (generate.py --run, python -m interop.hf export: router_aux_loss_coef) gets the run's config whole
    assert type(workload.family).from_record(meta, "ckpt").args == workload.args
    refusal = functools.partial(resume.refusal_for, cls)

    def check(saved, allow=()):
        (tmp_path / "ckpt").mkdir(exist_ok=True)
        (tmp_path / "ckpt" / "meta.json").write_text(json.dumps(saved))
        return resume.check_compatible(str(tmp_path / "ckpt"), meta, allow, refusal)

    earlier = json.loads(json.dumps(meta))
    earlier["model_args"]["ep_buffer_factor"] = earlier["train"].pop("ep_buffer_factor")
    check(earlier)  # (as it was saved: no change)
    earlier["model_args"]["ep_buffer_factor"] = 0.0
    for saved in (earlier, {**meta, "train": {**meta["train"], "ep_buffer_factor": 0.0}}):
        with pytest.raises(checkpoint.CheckpointError) as refused:
            check(json.loads(json.dumps(saved)))
        assert "ep_buffer_factor: saved 0.0, now 1.5); pass --allow-change ep_buffer_factor" in str(refused.value)
        check(json.loads(json.dumps(saved)), ["ep_buffer_factor"])  # deliberate: resumes
    assert cli.parse_config(["--allow-change", "ep_buffer_factor"]).allow_change == "ep_buffer_factor"
    retuned = {**meta, "train": {**meta["train"], "aux_loss_coef": 0.01, "moe_groups": 2}}  # (MoE's other two)
    with pytest.raises(checkpoint.CheckpointError, match=r"pass --allow-change aux_loss_coef,moe_groups to continue"):
        check(retuned)
    check(retuned, ["aux_loss_coef", "moe_groups"])
    other = json.loads(json.dumps(meta))
    other["model_args"]["moe_ffn_dim"] = 64  # a weight's shape: still another model, whatever is allowed
    with pytest.raises(checkpoint.CheckpointError) as refused:  # (naming the one field, not two whole configs)
        check(other, ["ep_buffer_factor"])
    assert str(refused.value).endswith("is from another model (model_args: saved {'moe_ffn_dim': 64}, "
                                       "this run {'moe_ffn_dim': 128})"), refused.value


def test_the_flux_family_is_whole_when_the_workload_is_built(tmp_path):
    """FluxFamily.configure changed the family from inside setup_data, so what was asked
    of it before (its parameter count: the trainer's memory check) depended on the call order. On a
    latent file (no learned class prompts) the count before setup_data is the built model's."""
    import train
    from tests.check_flux_trainer import _latent_file
    path = _latent_file(tmp_path / "lat.safetensors")
    workload = train.make_workload(train.parse_config(["--task", "flux", "--data", path, "--batch-size", "4"]))
    before = workload.family.param_count(workload.args)
    model = workload.family.build(workload.args)
    assert before == sum(p.numel() for p in model.parameters()) and model.prompt is None
    workload.setup_data(0, 1)
    assert workload.family.param_count(workload.args) == before


RUN_AND_LIST_WORKLOAD_MODULES = """
import sys, train
assert train.main(sys.argv[1:]) == 0
print(sorted(m for m in sys.modules if m.split(".")[0] in ("flux", "rl", "workloads")))
"""


def test_a_run_imports_only_its_own_workload(corpus, tmp_path):
    """Each parse imported every workload (`--task lm` loaded flux.*, rl.* and the
    vLLM handle), although task.py said a run imports only its own. A `--task lm` run of one step in a
    fresh process (a fork of one that has imported torch and train.py only: tests/launch.py) imports no
    flux or rl module; a flag of another workload still names its owner (run/cli.py parses again with every
    workload: test_a_flag_of_another_workload_or_a_bad_own_flag_is_one_line_exit_2)."""
    from tests import launch
    from tests.common import TINY
    rc, out, err = launch.python(["-c", RUN_AND_LIST_WORKLOAD_MODULES, *TINY, "--data", corpus, "--steps", "1",
                                  "--eval-batches", "0", "--sample-tokens", "0", "--out-dir", str(tmp_path / "r")])
    assert rc == 0 and out.strip().splitlines()[-1] == "['workloads', 'workloads.lm']", (out[-2000:], err[-2000:])


def _calls(path):
    """{function defined in the file: names it calls (f(...) and x.f(...))}."""
    import ast
    out = {}
    for fn in ast.walk(ast.parse(open(path).read())):
        if isinstance(fn, ast.FunctionDef):
            out[fn.name] = {c.func.attr if isinstance(c.func, ast.Attribute) else getattr(c.func, "id", None)
                            for c in ast.walk(fn) if isinstance(c, ast.Call)}
    return out


def test_each_decision_has_one_home(tmp_path):
    """Which checkpoint a resume takes was chosen again in rl/grpo_task.py; "the newest
    checkpoint that verifies" was written twice in run/checkpoint.py; the same bad record raised
    CheckpointError from the LM family and ConfigError from FLUX's; --batch-size's split over the mesh was
    checked by the trainer, not with the other flags in run/cli.py."""
    import json
    from run import checkpoint
    from run import cli
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    for d in ("", "flux", "rl"):
        for f in os.listdir(os.path.join(root, d)):
            if f.endswith(".py") and f not in ("run/checkpoint.py", "run/resume.py"):  # nobody else lists a run's checkpoints to pick one
                assert not any("step_dirs" in called for called in _calls(os.path.join(root, d, f)).values()), f
    verifying = {fn for f in ("run/checkpoint.py", "run/resume.py")
                 for fn, called in _calls(os.path.join(root, f)).items() if "verify" in called}
    assert verifying == {"newest_verified", "resolve"}, verifying
    for name in ("lm", "flux"):  # a record of no model of this version: the same kind from either family
        run = tmp_path / name
        os.makedirs(run)
        (run / "meta.json").write_text(json.dumps({"task": name, "model_args": {"warp": 9}, "train": {}, "files": {}}))
        with pytest.raises(checkpoint.CheckpointError, match="model_args"):
            checkpoint.load_run(str(run))
    with pytest.raises(cli.ConfigError, match="--batch-size 3 is not divisible by 2 data-parallel ranks"):
        cli.parse_config(["--batch-size", "3", "--mesh", "ici=2"])  # (before any rank starts)
    # GRPO's rows split over the ranks: checked there too, by the workload's own count
    # (it was a ConfigError raised in setup_data, once the ranks had started); its --batch-size is not its batch
    with pytest.raises(cli.ConfigError, match=r"^--prompts-per-step x --group-size = 9 rows is not divisible by 2 "):
        cli.parse_config(["--task", "grpo", "--prompts-per-step", "3", "--group-size", "3", "--mesh", "ici=2"])
    assert cli.parse_config(["--task", "grpo", "--prompts-per-step", "2", "--group-size", "3", "--batch-size", "3",
                             "--mesh", "ici=2"]).mesh == "ici=2"


class _Exchange:
    """A Parallel for rank `rank` of `n` data-parallel ranks in one process: rank 0's scatters and
    broadcasts are recorded, and replayed to the other ranks in the same order (what gloo would carry)."""

    def __new__(cls, rank, n, wire):
        import parallel

        class Exchange(parallel.Parallel):
            dp_rank, dp_size, global_rank = rank, n, rank

            def scatter_from_first(self, chunks, out):
                if rank == 0:
                    wire.append(chunks)
                return out.copy_((chunks if rank == 0 else wire[self._next()])[rank])

            def broadcast_from_first(self, x):
                if rank == 0:
                    wire.append(x.clone())
                return x if rank == 0 else x.copy_(wire[self._next()])

            def _next(self):
                self.i = getattr(self, "i", -1) + 1
                return self.i
        return Exchange("cpu")


class _StubEngine:
    """A rollout engine of seeded random completions (the exchange is under test, not the sampling)."""

    def sync(self, named, version):
        self.version = version
        return {"bytes": 0, "seconds": 0.0}

    def generate(self, prompts, group_size, C, temperature, seed, eos_id, batch_size):
        from rl.rollout import Rollout
        g = torch.Generator().manual_seed(seed)
        B = len(prompts) * group_size
        comp = torch.randint(48, 58, (B, C), generator=g)
        return Rollout(torch.tensor(prompts).repeat_interleave(group_size, 0), comp,
                       -torch.rand(B, C, generator=g), torch.rand(B, C, generator=g) < 0.8, self.version)


def test_grpo_exchanges_go_through_the_parallel_and_each_rank_receives_only_its_rows():
    """rl/grpo_task.py called torch.distributed itself, and rank 0 broadcast the whole
    rollout batch packed as float64 to ranks that keep B/N of it. Now two scatters (int64 completions and
    mask, float32 logprobs and advantages) through parallel.Parallel carry each rank its B/N rows, and
    the two ranks' batches are the one-process batch's halves (oracle: the one-process workload)."""
    import train
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    assert not any(n.startswith("torch.distributed") for n in _imports(os.path.join(root, "rl", "grpo_task.py")))
    argv = ["--task", "grpo", "--set", "dim=64", "--set", "n_heads=4", "--set", "n_layers=1", "--set", "max_seq_len=16",
            "--prompts-per-step", "4", "--group-size", "4"]
    batches, wire = [], []
    for rank, n in ((0, 1), (0, 2), (1, 2)):
        workload = train.make_workload(train.parse_config(argv))
        workload.setup_data(rank, n)
        workload.attach(workload.family.build(workload.args), _Exchange(rank, n, [] if n == 1 else wire))
        workload.engine = _StubEngine()
        batches.append(workload.batch(1))
    one, first, second = batches
    sent = [chunks for chunks in wire if isinstance(chunks, tuple)]
    assert len(sent) == 2 and all(len(c) == 2 and c[0].shape[0] == 8 for c in sent)  # B = 16 rows, 8 a rank
    assert {c[0].dtype for c in sent} == {torch.int64, torch.float32}
    for whole, a, b in zip(one[:4], first, second):  # tokens, mask, engine logprobs, advantages
        assert torch.equal(torch.cat([a, b]), whole)
    assert first[4] == second[4] == one[4] / 2  # the DAPO normalizer: the global token count over N
