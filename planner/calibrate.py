"""calibrate.py: the planner against published TPU runs (calibration.json), and the fit of its few
free constants. `python dryrun.py --calibrate` prints, for every run, the predicted and the published
step, their ratio and whether the published layout is predicted to fit; then the fitted constants.

The free constants are two a chip generation (chips.FITTED): the dense matmul efficiency and the MoE
experts' matmul efficiency, each the value minimizing the squared log ratio predicted / published
over the runs marked "fit" of that generation (dense runs first, then the MoE runs with the dense
value fixed: an MoE step also has dense attention and projections). Runs marked "held_out" never
enter the fit: they test it. Everything else in the model is published or a stated assumption.
"""
import json
import math
import os

from planner import chips as chips_lib
from planner import stepmodel
from planner.shapes import PLANNER_MODELS, flux_shape, lm_shape

DATA = os.path.join(os.path.dirname(os.path.abspath(__file__)), "calibration.json")
GRID = [round(0.20 + 0.005 * i, 3) for i in range(161)]   # efficiencies 0.20 .. 1.00


def load(path=DATA):
    with open(path) as f:
        return json.load(f)["runs"]


_SHAPES = {}  # the fit evaluates each run ~160 times; FLUX's parameter count builds the model on meta


def run_shape(run):
    """The Shape of a calibration run's model (model.FLAVORS, flux.FLAVORS or shapes.PLANNER_MODELS)."""
    key = json.dumps(run, sort_keys=True)
    if key not in _SHAPES:
        _SHAPES[key] = _build_shape(run)
    return _SHAPES[key]


def _build_shape(run):
    if run["model"].startswith("flux"):
        from flux import model as flux
        latent = run["image_size"] // 16       # VAE 8x down, then 2 x 2 patches
        return flux_shape(flux.FLAVORS[run["model"]], latent * latent, run["txt_tokens"], run["model"])
    from model import FLAVORS
    args = PLANNER_MODELS.get(run["model"]) or FLAVORS[run["model"]]
    return lm_shape(args, run["seq_len"], run["model"], capacity_factor=run.get("capacity_factor", 1.0),
                    moe_dispatch=run.get("moe_dispatch", "gmm"), fused_loss=run.get("fused_loss", False))


def run_layout(run):
    dp = run["dcn"] * run["ici"]
    return stepmodel.Layout(dcn=run["dcn"], ici=run["ici"], tp=run.get("tp", 1), ep=run.get("ep", 1),
                            local_batch=run["global_batch"] // dp, remat=run["remat"],
                            precision=stepmodel.PRECISIONS[run["precision"]], dp_mode=run["dp_mode"],
                            dcn_mode=run.get("dcn_mode", "replicate"),
                            attention_block=run.get("attention_block", stepmodel.ATTENTION_BLOCK))


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
            "host_gib": pred["offload_bytes"] / chips_lib.GiB, "predicted_mfu": pred["mfu"],
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


def fit(runs):
    """chip -> {matmul_efficiency, moe_efficiency}: least squared log ratio over the 'fit' runs."""
    fitted = {}
    for chip in sorted({r["chip"] for r in runs if r["role"] == "fit"}):
        mine = [r for r in runs if r["role"] == "fit" and r["chip"] == chip]
        shapes = {r["id"]: run_shape(r) for r in mine}
        dense = [r for r in mine if not shapes[r["id"]].n_experts]
        moe = [r for r in mine if shapes[r["id"]].n_experts]
        best = dict(chips_lib.efficiency(chip))
        if dense:
            best["matmul_efficiency"] = _argmin_on_grid(lambda e: _loss(dense, {**best, "matmul_efficiency": e}))
        if moe:
            best["moe_efficiency"] = _argmin_on_grid(lambda e: _loss(moe, {**best, "moe_efficiency": e}))
        fitted[chip] = best
    return fitted


def table(runs, constants_by_chip=None):
    """Rows for every run, with `constants_by_chip` (default: chips.FITTED)."""
    return [evaluate(r, (constants_by_chip or {}).get(r["chip"])) for r in runs]


def format_table(rows):
    lines = [f"{'run':<38} {'role':<8} {'chips':>5} {'chip':<8} {'predicted':>9} {'published':>9} {'ratio':>6} "
             f"{'fits':<4} {'HBM GiB':>7} {'host GiB':>8} {'MFU pred/pub':>13}"]
    for r in rows:
        lines.append(f"{r['id']:<38} {r['role']:<8} {r['chips']:>5} {r['chip']:<8} {r['predicted_s']:>8.3f}s "
                     f"{r['published_s']:>8.3f}s {r['ratio']:>6.2f} {'yes' if r['fits'] else 'NO':<4} "
                     f"{r['hbm_gib']:>7.1f} {r['host_gib']:>8.1f} {100 * r['predicted_mfu']:>5.1f}/{100 * r['published_mfu']:>4.1f}%")
    return "\n".join(lines)


def format_breakdown(row):
    """One run's step split into the model's terms (seconds and share of the step)."""
    p, step = row["prediction"], row["predicted_s"]
    parts = {**{f"compute: {k}": v for k, v in p["compute"].items()},
             "exposed ICI/DCN/offload (after overlap)": p["exposed_comm_s"],
             "TP collectives (exposed)": p["comm"]["tp"], "EP all-to-all (exposed)": p["comm"]["ep"],
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
    print(format_table(rows))
    print("fitted (chips.FITTED should hold these):")
    for chip, c in fitted.items():
        recorded = chips_lib.FITTED.get(chip)
        print(f"  {chip}: matmul_efficiency {c['matmul_efficiency']:.3f}, moe_efficiency {c['moe_efficiency']:.3f}"
              f"{'' if recorded == c else f'  (chips.FITTED has {recorded})'}")
    worst = max(rows, key=lambda r: abs(math.log(r["ratio"])))
    print(f"worst ratio {worst['ratio']:.2f} ({worst['id']}); all fit in HBM: {all(r['fits'] for r in rows)}")
    if "--breakdown" in argv:
        for r in rows:
            print(format_breakdown(r))
    return 0
