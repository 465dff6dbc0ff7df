# README.md's claims that the code can check. Oracles: the modules' own import statements (ast), read
# beside the README's file map
"""Part of the suite: collected and run through test_all.py (`pytest test_all.py`)."""
import os
import re

import pytest

from tests.check_seams import _imports, _our_modules


@pytest.mark.fast
def test_the_readme_maps_the_lesson_first_then_the_product_and_every_module():
    """The README's two tables: the lesson (every top-level module, from train.py, the step's four
    files first) and the product below it (packages). Their rows, read from the README: a `name.py`
    is that module, a `pkg/` the package's modules not on a row of their own (`planner/anchor.py`, which
    runs the trainer, sits with the benchmarks). Every module has a row, in its own table."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    ours = _our_modules(root)
    text = open(os.path.join(root, "README.md")).read()
    lesson_part, product_part = text.split("Below the lesson, the product:")
    table = lambda part: [re.findall(r"`([\w/.]+)`", line.split("|")[1]) for line in part.splitlines()
                          if line.startswith("| `")]
    lesson, product = table(lesson_part), table(product_part)
    assert [row[0] for row in lesson[:4]] == ["train.py", "step.py", "model.py", "optim.py"], lesson[:4]
    in_lesson = {n[:-3] for row in lesson for n in row}
    assert all("/" not in n for n in in_lesson), in_lesson
    named = {n[:-3].replace("/", "."): i for i, row in enumerate(product) for n in row if n.endswith(".py")}
    packages = {n[:-1] for row in product for n in row if n.endswith("/")}
    for m in ours:
        listed = m in in_lesson if "." not in m and not m.startswith("bench") else \
            m in named or m.split(".")[0] in packages
        assert listed, f"README's file map has no row for {m}"
    assert not in_lesson - set(ours), in_lesson - set(ours)
    assert not set(named) - set(ours) - {"test_all", "test_torch_tpu"}, set(named) - set(ours)

