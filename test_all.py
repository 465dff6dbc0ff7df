"""test_all.py: every concept checked against an independent oracle. Run: .venv/bin/python -m pytest test_all.py
(the README's command adds `-n 2 --dist loadgroup`: two workers, conftest.py says how; `-m fast` runs
the fast tier, one cheap oracle test per concept).

The checks live in tests/, one file per concept (or a few small ones), each opening with the oracles
it uses: formulas written out loop by loop (RoPE, GQA attention, MoE per token), torch's own
functional ops, torch.optim.AdamW and clip_grad_norm_, the uninterrupted run (resume), eager CPU
(XLA:CPU), JAX's production Pallas kernels, one process and FSDP2 (data parallel), the unrolled loop (scan), transformers' and diffusers' outputs. This file gathers them into one pytest
module, so that one command runs them all (pytest collects the test functions and fixtures in this
module's namespace, wherever they were written); tests/common.py holds the shared helpers. A test that
must run in a fresh process (XLA runtime first, torchrun ranks) calls one of the `child_*` functions through
`python test_all.py child_NAME ARGS`; tests/launch.py starts such processes as forks of one that has
already imported torch (checked against real ones first). CPU only; its count and time on 2 cores: README.
"""
import sys

import pytest

pytest.register_assert_rewrite("tests")  # (before the imports: pytest's detailed assert messages there too)

from tests.common import corpus, ctrl_c_as_in_a_terminal, fork_server  # noqa: E402,F401  (fixtures: found by name)
from tests.check_launch import *  # noqa: E402,F401,F403
from tests.check_model import *  # noqa: E402,F401,F403
from tests.check_optim_data import *  # noqa: E402,F401,F403
from tests.check_checkpoint import *  # noqa: E402,F401,F403
from tests.check_refusals import *  # noqa: E402,F401,F403
from tests.check_kernels import *  # noqa: E402,F401,F403
from tests.check_tpu_compile import *  # noqa: E402,F401,F403
from tests.check_expert_exchange import *  # noqa: E402,F401,F403
from tests.check_parallel import *  # noqa: E402,F401,F403
from tests.check_context_parallel import *  # noqa: E402,F401,F403
from tests.check_elastic import *  # noqa: E402,F401,F403
from tests.check_graph import *  # noqa: E402,F401,F403
from tests.check_accum import *  # noqa: E402,F401,F403
from tests.check_layer_scan import *  # noqa: E402,F401,F403
from tests.check_materialize import *  # noqa: E402,F401,F403
from tests.check_dryrun import *  # noqa: E402,F401,F403
from tests.check_planner import *  # noqa: E402,F401,F403
from tests.check_seams import *  # noqa: E402,F401,F403
from tests.check_readme import *  # noqa: E402,F401,F403
from tests.check_hf import *  # noqa: E402,F401,F403
from tests.check_flux import *  # noqa: E402,F401,F403
from tests.check_flux_trainer import *  # noqa: E402,F401,F403
from tests.check_flux_pipeline import *  # noqa: E402,F401,F403
from tests.check_grpo import *  # noqa: E402,F401,F403
from tests.check_dpo import *  # noqa: E402,F401,F403
from tests.check_vllm import *  # noqa: E402,F401,F403
from tests.check_profiling import *  # noqa: E402,F401,F403
from tests.check_step_compile import *  # noqa: E402,F401,F403

if __name__ == "__main__":  # child processes: python test_all.py <child function> [args...]
    globals()[sys.argv[1]](*sys.argv[2:])
