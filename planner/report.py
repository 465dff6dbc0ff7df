"""planner/report.py: the dry run's printed forms: one layout's report (memory, host memory, FLOPs,
collectives, the step time and its parts) and --plan's table of ranked layouts, each from the dicts
dryrun.estimate returns (the dry run prints them as JSON after the text)."""
from planner import chips as chips_lib
from planner.chips import GiB


def remat_label(remat):
    """off / on (--remat), a policy's name, or a custom policy's places (offload:decoder_layer_input)."""
    if isinstance(remat, dict):
        return ",".join(f"{place}:{name}" for name, place in remat.items())
    return {True: "on", False: "off"}.get(remat, remat)


def format_plan(rows, cfg, top=15):
    width = max(5, *(len(remat_label(r["remat"])) for r in rows[:top]))
    lines = [f"plan: {rows[0]['flavor']} on {cfg.chips} x {cfg.chip}, global batch {cfg.batch_size} x "
             f"{rows[0]['seq_len']} tokens"
             + (f" in {rows[0]['microbatches']} microbatches" if rows[0]["microbatches"] > 1 else "") + "; "
             f"{len(rows)} layouts x memory policies, best {min(top, len(rows))}, fitting first (step: stepmodel.py's "
             f"parts, {calibration_note(cfg.chip)}; not run on a TPU)",
             f"  {'mesh':<28} {'remat':<{width}} {'batch/dp':>8} {'HBM GiB':>8} {'host GiB':>8} {'fits':<4} {'step ms':>9} "
             f"{'TP/EP/CP':>9} {'MFU':>6}  bound"]
    for r in rows[:top]:
        lines.append(f"  {r['mesh']:<28} {remat_label(r['remat']):<{width}} {r['local_batch']:>8} "
                     f"{r['total_bytes'] / GiB:>8.1f} {r['host_need'] / GiB:>8.1f} {'yes' if r['fits'] else 'NO':<4} {r['step_s'] * 1e3:>9.1f} "
                     f"{r['exposed_s'] * 1e3:>9.1f} {100 * r['mfu']:>5.1f}%  {r['bound']}")
    return "\n".join(lines)


def calibration_note(chip):
    """Whether `chip`'s efficiencies were fitted on published runs (calibration.json) or defaulted."""
    if chip in chips_lib.FITTED:
        return "calibrated on published runs"
    return "UNCALIBRATED: no fit run of this chip, default efficiencies (calibrate's held-out rows show how far off)"


def format_report(r):
    lines = [f"dry run: {r['flavor']} ({r['params'] / 1e9:.2f}B params) on {r['devices']} x {r['chip']} "
             f"({r['mesh']}), {r['local_batch']} x {r['seq_len']} tokens per device"
             + (f" in {r['microbatches']} microbatches" if r["microbatches"] > 1 else "")]
    for name, b in r["memory_bytes"].items():
        lines.append(f"  {name:<36} {b / GiB:10.2f} GiB")
    short = r["total_bytes"] - r["hbm_bytes"]
    verdict = "fits" if short <= 0 else f"DOES NOT FIT: short by {short / GiB:.2f} GiB"
    lines.append(f"  {'total per device':<36} {r['total_bytes'] / GiB:10.2f} GiB of {r['hbm_bytes'] / GiB:.0f} GiB HBM: {verdict}")
    host = ", ".join(f"{k} {v / GiB:.2f}" for k, v in r["host_memory_bytes"].items())
    source = chips_lib.CHIPS[r["chip"]].host_source
    host_verdict = "fits" if r["host_need"] <= r["host_capacity"] else "DOES NOT FIT"
    lines.append(f"  host memory a chip ({host} GiB): needs {r['host_need'] / GiB:.2f} of "
                 f"{r['host_capacity'] / GiB:.0f} GiB ({'ASSUMED' if source == 'assumed' else source}): {host_verdict}")
    split = ", ".join(f"{k} {v / GiB:.2f}" for k, v in r["ici_split"].items() if v)
    lines.append(f"  FLOPs per device per step {r['flops_per_device']:.3e}; collectives per device per step: "
                 f"ICI {r['ici_bytes'] / GiB:.2f} GiB ({split or 'none'}), DCN {r['dcn_bytes'] / GiB:.2f} GiB")
    parts = ", ".join(f"{k} {v * 1e3:.1f}" for k, v in r["step_parts_s"].items())
    lines.append(f"  predicted step time {r['step_s'] * 1e3:.1f} ms ({parts} ms; + host overhead), MFU "
                 f"{100 * r['mfu']:.1f}% (stepmodel.py, {calibration_note(r['chip'])}; largest part: {r['bound']})")
    return "\n".join(lines)
