"""planner/report.py: the dry run's printed forms: one layout's report (memory, host memory, FLOPs,
collectives, the step time and its parts) and --plan's table of ranked layouts, each from the dicts
dryrun.estimate returns (the dry run prints them as JSON after the text), and --compile's report:
the compiler's figures beside the planner's (step_compile.compare's dict)."""
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


COMPILED_POLICIES = {False: "remat off", True: "remat on", "full": "--scan (each layer's input kept, its forward replayed)"}


def compiled_policy_label(remat):
    if isinstance(remat, dict):  # (--scan --offload: dryrun.compiled_report's policy)
        return "--scan --offload (each layer's input offloaded to host, its forward replayed)"
    return COMPILED_POLICIES.get(remat, remat)


def format_compiled(r, planned):
    """--compile's report (judged): the compiler's figures (step_compile.compare) beside the planner's."""
    g = lambda b: f"{b / GiB:10.3f} GiB"
    head = (f"compiled for {r['topology']} ({planned['devices']} x {planned['chip']}, mesh {planned['mesh']}): "
            f"{planned['flavor']}, {planned['local_batch']} x {planned['seq_len']} tokens per data-parallel rank, "
            f"{compiled_policy_label(planned['remat'])}; XLA:TPU on compile-only devices, no chip"
            + (f"; compile effort {r['compile_effort']:g}, not XLA's default 0: the same program, its temporaries "
               f"and fit those of a less-worked schedule" if r.get("compile_effort") else ""))
    if not r["compiler_fits"]:
        return head
    unit = "per device" if r["devices_per_chip"] == 1 else f"per chip (the compiler's {r['devices_per_chip']} devices)"
    # (with host buffers the compiler's peak counts them: the HBM its buffer assignment reserves)
    total_label = "total: HBM its buffers reserve (compiler)" if r["host_bytes"] else "total: the peak (compiler: its buffers)"
    lines = [head, f"  {unit:<44} {'compiler':>14} {'planner':>14}",
             f"  {'arguments (weights, AdamW state, batch)':<44} {g(r['argument_bytes'])} {g(r['planned_state_bytes'])}",
             f"  {'temporaries (grads, activations, workspace)':<44} {g(r['temp_bytes'])} {g(r['planned_temp_bytes'])}",
             f"  {'  of which the FSDP gathered block':<44} {'':>14} {g(r['planned_gathered_bytes'])}",
             f"  {'outputs not aliased to an argument':<44} {g(r['output_bytes'])} {g(0)}",
             f"  {total_label:<44} {g(r['total_bytes'])} {g(r['planned_total_bytes'])}   of {r['hbm_bytes'] / GiB:.0f} GiB HBM"
             + (f"; the sizes above add to {r['summed_bytes'] / GiB:.3f}" if r["summed_bytes"] != r["total_bytes"] else ""),
             f"  {'fits':<44} {'yes' if r['fits'] else 'NO':>14} {'yes' if r['planned_fits'] else 'NO':>14}",
             f"  {'host memory (offloaded activations)':<44} {g(r['host_bytes'])} {g(r['planned_host_bytes'])}",
             f"  {'FLOPs (compiler / flops_per_step)':<44} {r['flops']:14.4e} {r['flops_per_step']:14.4e}   "
             f"ratio {r['flops'] / r['flops_per_step']:.4f}" + ("  (remat: the excess is the recompute)" if planned["remat"] else "")
             + (f"\n  {'  left out: inside the Mosaic kernels':<44} {'':>14} {r['kernel_flops']:14.4e}   "
                "(the cost model does not see them: FLOPs, step and MFU are the rest's)" if r["kernel_flops"] else ""),
             f"  {'step time (cost model estimate / stepmodel)':<44} {r['estimated_step_s'] * 1e3:11.3f} ms "
             f"{r['planned_step_s'] * 1e3:11.3f} ms",
             f"  {'MFU implied (estimate / stepmodel)':<44} {100 * r['estimated_mfu']:13.1f}% {100 * r['planned_mfu']:13.1f}%",
             f"  {'  at the cost model own matmul rate':<44} {100 * r['cost_model_mfu']:13.1f}%   (it prices a bf16 matmul "
             f"at {r['cost_model_rate'] / 1e12:.1f} TFLOP/s: step {r['rescaled_step_s'] * 1e3:.1f} ms at the chip's peak)",
             f"  compile {r['compile_s']:.1f} s (the compiler's cost model estimates the step time: not a measurement); "
             f"{r['mosaic_calls']} Mosaic kernel call(s)"]
    if "twin_fits" in r:
        lines.append(f"  the same step in pure JAX (its twin), same topology, layout and attention: "
                     + (f"{r['twin_total_bytes'] / GiB:.3f} GiB, FLOPs {r['twin_flops']:.4e}, estimated step "
                        f"{r['twin_step_s'] * 1e3:.3f} ms: ours at {r['twin_speed']:.3f}x its speed (its step over ours)"
                        if r["twin_fits"] else "does not fit"))
    if r["flops"] and not r["estimated_step_s"]:
        lines[10:13] = ["  step time: no estimate (the cost model's figure for a program across slices is negative, not a time)"]
    if not r["flops"]:
        lines[9:13] = [f"  FLOPs and step not counted: {r.get('uncounted') or 'the compiler gave none'}"]
    return "\n".join(lines)


def judged(r, planned):
    """The compile's report (step_compile.compare's dict) printed beside the plan, then its JSON line (also
    for a step that does not fit: its figures, for a table); one `error:` line (ValueError) when it
    does not fit."""
    import json
    print(format_compiled(r, planned), flush=True)
    print(json.dumps(r), flush=True)
    effort = f" (at --compile-effort {r['compile_effort']:g}, not XLA's default 0)" if r.get("compile_effort") else ""
    if not r["compiler_fits"]:
        raise ValueError(f"does not fit {r['topology']}: the TPU compiler says {r['message']}{effort}")
    if not r["fits"]:
        raise ValueError(f"does not fit {r['topology']}: the compiler's HBM at its peak (arguments, temporaries, outputs) is "
                         f"{r['total_bytes'] / GiB:.2f} GiB a {'device' if r['devices_per_chip'] == 1 else 'chip'}, "
                         f"over its {r['hbm_bytes'] / GiB:.0f} GiB HBM{effort}")
    return 0
