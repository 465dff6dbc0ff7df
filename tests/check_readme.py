# README.md's claims that the code can check. Oracles: the modules' own import statements (ast), read
# beside the README's file map
"""Part of the suite: collected and run through test_all.py (`pytest test_all.py`)."""
import os
import re

import pytest

from tests.check_seams import _imports, _our_modules


@pytest.mark.fast
def test_the_readme_file_map_is_in_import_order_and_lists_every_module():
    """The README's file map says each file imports only files above it. Its rows, read from the
    README: a `name.py` is that module, a `pkg/` the package's modules not on a row of their own
    (`planner/anchor.py`, which runs the trainer, sits with the benchmarks). Every import of every
    module (function-level ones too) points at its own row or one above, and every module has a row."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    ours = _our_modules(root)
    rows = [re.findall(r"`([\w/.]+)`", line.split("|")[1]) for line in open(os.path.join(root, "README.md"))
            if line.startswith("| `")]
    named = {n[:-3].replace("/", "."): i for i, row in enumerate(rows) for n in row if n.endswith(".py")}
    packages = {n[:-1]: i for i, row in enumerate(rows) for n in row if n.endswith("/")}
    row_of = {}
    for m in ours:
        row = named.get(m, packages.get(m.split(".")[0]) if "." in m else None)
        assert row is not None, f"README's file map has no row for {m}"
        row_of[m] = row
    assert not set(named) - set(ours) - {"test_all", "test_torch_tpu"}, set(named) - set(ours)
    upward = sorted((m, n) for m, p in ours.items() for n in _imports(p) if n in ours and row_of[n] > row_of[m])
    assert not upward, f"imports of a file below it in the README's file map: {upward}"

