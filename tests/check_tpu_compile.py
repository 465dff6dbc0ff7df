# tpu_target.py + tpu_kernels.py: our Pallas kernels compiled for a TPU. Oracle: the TPU compiler
# itself (XLA:TPU and Mosaic, in libtpu, on compile-only devices: no chip), which refuses a block
# layout Mosaic cannot lower, a kernel whose blocks overflow VMEM, temporaries that overflow HBM.
"""Part of the suite: collected and run through test_all.py (`pytest test_all.py`)."""
import json

import pytest

from tests import launch

CHIP = "tpu_v5p"  # one chip, in .venv's jax 0.7.1 + libtpu 0.0.24 (the sweep covers v6e and Ironwood)
MiB = 2**20


def _compiled(kernel):
    """`tpu_kernels.py one KERNEL tpu_v5p` in a fresh process (libtpu loads into it, never into the
    suite's): its JSON row. A missing compile environment fails here, in one line."""
    rc, out, err = launch.python(["tpu_kernels.py", "one", kernel, CHIP], timeout=600)
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert rc == 0, (lines or ["(no stderr)"])[-1]
    row = json.loads(out.strip().splitlines()[-1])
    ours = row["ours"]
    assert "error" not in ours, f"the TPU compiler refused our {kernel}: {ours.get('error')}"
    assert ours["fits"], ours["message"]
    # forward + both backward kernels went through Mosaic (interpret mode would leave none)
    assert ours["mosaic_calls"] == row["expected_mosaic_calls"], ours["mosaic_calls"]
    return ours


@pytest.mark.parametrize("kernel, temp_below", [
    # splash, B 1, 32 query / 8 kv heads, S 8192, D 128, causal, block 512: XLA's attention keeps
    # 32 heads of fp32 S x S scores (8 GiB); ours per-row vectors and the forward's output (measured
    # 256 MiB): bound 1/16 of the scores
    ("splash", 32 * 8192 * 8192 * 4 // 16),
    # fused CE, 8192 rows, hidden 4096, Llama 3's vocab 128256: the fp32 logits are 3.9 GiB; ours
    # none of that size (measured 4 MiB; 2 GiB when the vocabulary was padded to whole tiles: a copy
    # of w and of its gradient): bound 64 MiB
    ("ce", 64 * MiB),
    # gmm, Mixtral's experts: 8192 rows x 4096 by 8 x 4096 x 14336, group sizes data (any split:
    # uneven, empty): bound the bf16 weights' size (measured 224 MiB: the row tiles' padding, dx)
    ("gmm", 8 * 4096 * 14336 * 2),
])
def test_kernel_forward_and_backward_compile_for_tpu_v5p(kernel, temp_below):
    """Each kernel's forward + backward at a production shape, compiled for v5p: Mosaic lowers all
    three of its kernels, their blocks fit VMEM (the compiler's check), and the HBM temporaries are
    a fraction of what the XLA computation it replaces materializes."""
    ours = _compiled(kernel)
    assert ours["temp_bytes"] < temp_below, (ours["temp_bytes"] / MiB, temp_below / MiB)
