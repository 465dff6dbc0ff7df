"""calibrate.py: the planner against published TPU runs (calibration.json), and the fit of its few
free constants. `python -m planner.dryrun --calibrate` prints, for every run, the predicted and the published
step, their ratio and whether the published layout is predicted to fit; then the fitted constants.

The free constants are two a chip generation (chips.FITTED): the dense matmul efficiency and the MoE
experts' matmul efficiency, each the value minimizing the squared log ratio predicted / published
over the runs marked "fit" of that generation (dense runs first, then the MoE runs with the dense
value fixed: an MoE step also has dense attention and projections); a constant with no run keeps
chips.DEFAULT_EFFICIENCY's. Runs marked "held_out" never enter the fit: they test it. Three tables:
the fit (each fit run under the constants fitted on all fit runs; a constant that rests on that run
alone says so), leave-one-out (each fit run under the constants fitted without it: a constant
resting on it alone falls back to the default there) and held out. Everything else in the model is
published or a stated assumption.
"""
import json
import math
import os

from planner import chips as chips_lib
from planner import stepmodel
from planner.shapes import PLANNER_MODELS, lm_shape
from run import cli
import task as task_lib
from model import FLAVORS

DATA = os.path.join(os.path.dirname(os.path.abspath(__file__)), "calibration.json")
GRID = [round(0.20 + 0.005 * i, 3) for i in range(161)]   # efficiencies 0.20 .. 1.00


# Every field a run may carry; anything else is refused, so nothing written into a run is dropped unread
FIELDS = {"id", "role", "model", "chip", "dcn", "ici", "tp", "ep", "global_batch", "seq_len", "image_size",
          "txt_tokens", "precision", "mu_dtype", "dp_mode", "dcn_mode", "remat", "attention_block", "vocab_tiles",
          "capacity_factor", "moe_dispatch", "fused_loss", "published", "source", "assumed", "outside_band"}


def load(path=DATA):
    with open(path) as f:
        runs = json.load(f)["runs"]
    for run in runs:
        unknown = sorted(set(run) - FIELDS)
        if unknown:
            raise ValueError(f"calibration run {run.get('id')!r}: the planner does not model {', '.join(unknown)} "
                             f"(it reads {', '.join(sorted(FIELDS))})")
        try:  # (a precision the planner does not know, or one the chip publishes no peak for: one line)
            chips_lib.matmul_peak(chips_lib.CHIPS[run["chip"]], stepmodel.precision(run["precision"]).matmul)
        except (KeyError, ValueError) as e:
            raise ValueError(f"calibration run {run.get('id')!r}: {e}") from None
    return runs


_SHAPES = {}  # the fit evaluates each run ~160 times; FLUX's parameter count builds the model on meta


def run_shape(run):
    """The Shape of a calibration run's model (model.FLAVORS, flux.FLAVORS or shapes.PLANNER_MODELS)."""
    key = json.dumps(run, sort_keys=True)
    if key not in _SHAPES:
        _SHAPES[key] = _build_shape(run)
    return _SHAPES[key]


def family_shape(task_name, flags):
    """The Shape a model family describes itself by (ModelFamily.plan(args, cfg).shape) for the command
    line `--task task_name --dry-run *flags`: reached through task.WORKLOADS, so planner/ imports no
    workload. (Nothing is traced: the Workload's activation bytes are traced only when asked for.)"""
    cfg = cli.parse_config(["--task", task_name, "--dry-run", *flags])
    w = task_lib.workload_class(task_name)(cfg)
    return w.family.plan(w.args, cfg).shape


def _build_shape(run):
    if run["model"].startswith("flux"):
        shape = family_shape("flux", ["--flavor", run["model"], "--image-size", str(run["image_size"])])
        latent = run["image_size"] // 16       # VAE 8x down, then 2 x 2 patches
        if shape.tokens != latent * latent + run["txt_tokens"]:
            raise ValueError(f"{run['id']}: the FLUX family plans {shape.tokens} tokens a sample, the run says "
                             f"{latent * latent} image + {run['txt_tokens']} text")
        return shape
    args = PLANNER_MODELS.get(run["model"]) or FLAVORS[run["model"]]
    return lm_shape(args, run["seq_len"], run["model"], capacity_factor=run.get("capacity_factor", 1.0),
                    moe_dispatch=run.get("moe_dispatch", "gmm"), fused_loss=run.get("fused_loss", False))


def run_layout(run):
    dp = run["dcn"] * run["ici"]
    return stepmodel.Layout(dcn=run["dcn"], ici=run["ici"], tp=run.get("tp", 1), ep=run.get("ep", 1),
                            local_batch=run["global_batch"] // dp, remat=run["remat"],
                            precision=stepmodel.precision(run["precision"], run.get("mu_dtype")),
                            dp_mode=run["dp_mode"], dcn_mode=run.get("dcn_mode", "replicate"),
                            attention_block=run.get("attention_block", stepmodel.ATTENTION_BLOCK),
                            vocab_tiles=run.get("vocab_tiles", 1))


def published_step(run, shape):
    """The published step in seconds, from whichever figure the source gives."""
    pub, chips = run["published"], run["dcn"] * run["ici"] * run.get("tp", 1)
    if "step_s" in pub:
        return pub["step_s"]
    if "tokens_per_s_per_chip" in pub:
        return run["global_batch"] * shape.tokens / (pub["tokens_per_s_per_chip"] * chips)
    peak = chips_lib.CHIPS[run["chip"]].peak_flops
    return shape.model_flops * run["global_batch"] / (pub["mfu"] * chips * peak)


def evaluate(run, constants=None):
    """One table row: the prediction for a run beside its published step."""
    shape = run_shape(run)
    chip = chips_lib.CHIPS[run["chip"]]
    pred = stepmodel.predict(shape, run_layout(run), chip, constants)
    published = published_step(run, shape)
    return {"id": run["id"], "role": run["role"], "chip": run["chip"], "chips": run["dcn"] * run["ici"] * run.get("tp", 1),
            "predicted_s": pred["step_s"], "published_s": published, "ratio": pred["step_s"] / published,
            "fits": pred["fits"], "hbm_gib": pred["total_bytes"] / chips_lib.GiB,
            "host_gib": pred["host_need"] / chips_lib.GiB, "predicted_mfu": pred["mfu"],
            "published_mfu": pred["mfu"] * pred["step_s"] / published, "prediction": pred}


def _loss(runs, constants):
    return sum(math.log(evaluate(r, constants)["ratio"]) ** 2 for r in runs)


def _argmin_on_grid(loss):
    """The GRID value minimizing `loss`, by ternary search over the grid's indices (the squared log
    ratios are unimodal in one efficiency: every predicted step falls as the efficiency rises)."""
    lo, hi = 0, len(GRID) - 1
    while hi - lo > 2:
        a, b = lo + (hi - lo) // 3, hi - (hi - lo) // 3
        if loss(GRID[a]) <= loss(GRID[b]):
            hi = b
        else:
            lo = a
    return min(GRID[lo:hi + 1], key=loss)


def constant_of(run):
    """The fitted constant a run's fit decides: its chip's MoE efficiency for an MoE model, else the dense one."""
    return run["chip"], "moe_efficiency" if run_shape(run).n_experts else "matmul_efficiency"


def fit(runs):
    """chip -> {matmul_efficiency, moe_efficiency}: least squared log ratio over the 'fit' runs (a
    constant no fit run decides: chips.DEFAULT_EFFICIENCY's)."""
    fitted = {}
    for chip in sorted({r["chip"] for r in runs if r["role"] == "fit"}):
        mine = [r for r in runs if r["role"] == "fit" and r["chip"] == chip]
        shapes = {r["id"]: run_shape(r) for r in mine}
        dense = [r for r in mine if not shapes[r["id"]].n_experts]
        moe = [r for r in mine if shapes[r["id"]].n_experts]
        best = dict(chips_lib.DEFAULT_EFFICIENCY)
        if dense:
            best["matmul_efficiency"] = _argmin_on_grid(lambda e: _loss(dense, {**best, "matmul_efficiency": e}))
        if moe:
            best["moe_efficiency"] = _argmin_on_grid(lambda e: _loss(moe, {**best, "moe_efficiency": e}))
        fitted[chip] = best
    return fitted


def table(runs, constants_by_chip=None):
    """Rows for every run, with `constants_by_chip` (default: chips.FITTED); a fit run whose constant
    no other fit run decides says so (`note`)."""
    fit_runs = [r for r in runs if r["role"] == "fit"]
    rows = []
    for r in runs:
        row = evaluate(r, (constants_by_chip or {}).get(r["chip"]))
        alone = r["role"] == "fit" and [constant_of(o) for o in fit_runs].count(constant_of(r)) == 1
        why = r.get("outside_band", "") if not 0.75 <= row["ratio"] <= 1.25 else ""
        row["note"] = "; ".join(n for n in (f"{constant_of(r)[1]} of {r['chip']} rests on this run alone" if alone else "",
                                            why) if n)
        rows.append(row)
    return rows


def leave_one_out(runs):
    """Each fit run predicted with the constants fitted on the other fit runs (a constant only it
    decided falls back to chips.DEFAULT_EFFICIENCY, and the row says so)."""
    fit_runs = [r for r in runs if r["role"] == "fit"]
    rows = []
    for r in fit_runs:
        others = [o for o in fit_runs if o is not r]
        constants = fit(others).get(r["chip"], dict(chips_lib.DEFAULT_EFFICIENCY))
        row = evaluate(r, constants)
        alone = constant_of(r) not in [constant_of(o) for o in others]
        row["note"] = f"no other run decides {constant_of(r)[1]} of {r['chip']}: the default" if alone else ""
        rows.append(row)
    return rows


def format_table(rows):
    lines = [f"{'run':<40} {'role':<8} {'chips':>5} {'chip':<8} {'predicted':>9} {'published':>9} {'ratio':>6} "
             f"{'fits':<4} {'HBM GiB':>7} {'host GiB':>8} {'MFU pred/pub':>13}"]
    for r in rows:
        band = "" if 0.75 <= r["ratio"] <= 1.25 else "  OUTSIDE +-25%"
        lines.append(f"{r['id']:<40} {r['role']:<8} {r['chips']:>5} {r['chip']:<8} {r['predicted_s']:>8.3f}s "
                     f"{r['published_s']:>8.3f}s {r['ratio']:>6.2f} {'yes' if r['fits'] else 'NO':<4} "
                     f"{r['hbm_gib']:>7.1f} {r['host_gib']:>8.1f} {100 * r['predicted_mfu']:>5.1f}/{100 * r['published_mfu']:>4.1f}%"
                     f"{band}{'  (' + r['note'] + ')' if r.get('note') else ''}")
    return "\n".join(lines)


def format_breakdown(row):
    """One run's step split into the model's terms (seconds and share of the step)."""
    p, step = row["prediction"], row["predicted_s"]
    parts = {**{f"compute: {k}": v for k, v in p["compute"].items()},
             "exposed ICI/DCN/offload (after overlap)": p["exposed_comm_s"],
             "TP collectives (exposed)": p["comm"]["tp"], "EP all-to-all (exposed)": p["comm"]["ep"], "CP K/V all-gather (exposed)": p["comm"]["cp"],
             "host overhead": p["host_overhead_s"]}
    lines = [f"{row['id']}: predicted {step:.3f} s (published {row['published_s']:.3f} s), MFU {100 * row['predicted_mfu']:.1f}%"]
    for k, v in parts.items():
        lines.append(f"  {k:<42} {v:9.3f} s {100 * v / step:5.1f}%")
    hidden = p["comm"]["ici"] + p["comm"]["dcn"] + p["comm"]["offload"]
    lines.append(f"  (interconnect + offload before overlap: ICI {p['comm']['ici']:.3f} s, DCN {p['comm']['dcn']:.3f} s, "
                 f"host link {p['comm']['offload']:.3f} s; {hidden - p['exposed_comm_s']:.3f} s hidden)")
    return "\n".join(lines)


def main(argv=()):
    runs = load()
    fitted = fit(runs)
    rows = table(runs, fitted)
    print("calibration (calibration.json; predicted with the fitted constants below; not run on a TPU here)")
    print("fit: each fit run under the constants fitted on all fit runs")
    print(format_table([r for r in rows if r["role"] == "fit"]))
    loo = leave_one_out(runs)
    print("leave-one-out: each fit run under the constants fitted without it")
    print(format_table(loo))
    print("held out: never in the fit (chips with no fit run use the default efficiencies: uncalibrated)")
    print(format_table([r for r in rows if r["role"] == "held_out"]))
    print("fitted (chips.FITTED should hold these):")
    for chip, c in fitted.items():
        recorded = chips_lib.FITTED.get(chip)
        print(f"  {chip}: matmul_efficiency {c['matmul_efficiency']:.3f}, moe_efficiency {c['moe_efficiency']:.3f}"
              f"{'' if recorded == c else f'  (chips.FITTED has {recorded})'}")
    for name, group in (("fit", [r for r in rows if r["role"] == "fit"]), ("leave-one-out", loo),
                        ("held out", [r for r in rows if r["role"] == "held_out"])):
        worst = max(group, key=lambda r: abs(math.log(r["ratio"])))
        inside = sum(0.75 <= r["ratio"] <= 1.25 for r in group)
        print(f"{name}: {inside} of {len(group)} within +-25%, worst {worst['ratio']:.2f} ({worst['id']}); "
              f"published layouts predicted to fit: {sum(r['fits'] for r in group)} of {len(group)}")
    if "--breakdown" in argv:
        for r in rows:
            print(format_breakdown(r))
    return 0
