"""planner/: what planner/dryrun.py predicts a full-scale TPU step from, and how that was checked. Nothing here
has a TPU: every number is the planner's, calibrated against published runs.

Read in this order:

    chips.py          each chip's constants with their source (TPU v4, v5e, v5p, v6e, Ironwood, H100;
                      a measured CPU) and the efficiencies fitted on published runs
    shapes.py         a model as the step model sees it: its matmuls, attention and the named activations
                      its backward reads (language models; planner-only Llama 2 70B, Mixtral 8x7B / 8x22B;
                      another family describes its own through ModelFamily.plan: FLUX in flux/shape.py);
                      MaxText's and MaxDiffusion's remat policies, an unknown name refused
    activations.py    a workload's saved-activation bytes, traced from its whole step on meta tensors
    stepmodel.py      step time and memory from named parts: matmuls at a shape-dependent fraction of peak,
                      splash attention, HBM-bound ops, collectives (latency + bytes / bandwidth, overlapped),
                      host offload, a host overhead; the host memory a process needs; `fits`, the one verdict
    report.py         the dry run's printed report of one layout and --plan's table
    calibrate.py      calibration.json's published runs predicted and compared; the fit of the free
                      constants, leave-one-out and the held-out runs (`python -m planner.dryrun --calibrate`)
    anchor.py         this CPU as the chip: predicted against the measured default step (`python -m planner.anchor`)
    compile_column.py the calibration table's compiler column (`python -m planner.dryrun --calibrate --compile`)
"""
