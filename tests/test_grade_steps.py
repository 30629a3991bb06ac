"""``ddplab.grade``'s steps are listed once (``STEPS``); its docstring and docs/contributing.md
name the same steps with the same modules, in the same order, and no module of the package is
left out of them (issue 59 item 7)."""

from __future__ import annotations

import re
from pathlib import Path

import ddplab.grade as grade

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = Path(grade.__file__).parent
MODULES = {p.stem for p in PACKAGE.glob("*.py") if p.stem != "__init__"}


def _modules_named(text: str) -> list[str]:
    """The modules of ddplab.grade that ``text`` names in backquotes, in order, each once."""
    named = re.findall(r"`+([A-Za-z_]+)`+", text)
    return list(dict.fromkeys(n for n in named if n in MODULES))


def _docstring_steps() -> list[tuple[str, list[str]]]:
    """(step, modules) of each numbered item of the package's docstring."""
    items = re.split(r"^(\d+)\. ", grade.__doc__, flags=re.M)[1:]
    found = []
    for number, text in zip(items[::2], items[1::2]):
        text = text.split("\n\n")[0]                # the item ends at the paragraph's end
        assert int(number) == len(found), f"step {number} is numbered out of order"
        found.append((text.split(",")[0], _modules_named(text)))
    return found


def _contributing_steps() -> list[tuple[str, list[str]]]:
    """(step, modules) of docs/contributing.md's ``ddplab/grade/`` line: ``step (...) → ...``."""
    line = next(line for line in (ROOT / "docs" / "contributing.md").read_text().splitlines()
                if line.startswith("- `ddplab/grade/`:"))
    flow = line.split("whose docstring says what each does. ", 1)[1].rsplit(". `class_run`", 1)[0]
    return [(part.split(" (")[0], _modules_named(part)) for part in flow.split(" → ")]


def test_every_module_of_the_package_belongs_to_one_step_or_drives_them():
    listed = [module for _, modules in grade.STEPS for module in modules]
    assert len(listed) == len(set(listed)), f"a module in two steps: {listed}"
    assert sorted([*listed, grade.DRIVER]) == sorted(MODULES), \
        f"in the package but in no step: {sorted(MODULES - set(listed) - {grade.DRIVER})}; " \
        f"in a step but not in the package: {sorted(set(listed) - MODULES)}"


def test_the_docstring_lists_the_steps_of_STEPS_in_order():
    expected = [(step, list(modules)) for step, modules in grade.STEPS]
    assert _docstring_steps() == expected


def test_the_contributing_guide_lists_the_steps_of_STEPS_in_order():
    expected = [(step, list(modules)) for step, modules in grade.STEPS]
    assert _contributing_steps() == expected


def test_a_step_or_module_out_of_place_is_seen():
    """The parsers above read what they claim: a swapped pair of steps, or a module named in the
    wrong step, makes the lists differ."""
    doc = grade.__doc__
    swapped = doc.replace("1. cells, ``cells``", "1. cells, ``run``", 1)
    assert swapped != doc
    original, grade.__doc__ = grade.__doc__, swapped
    try:
        assert _docstring_steps()[1] == ("cells", ["run"])
        assert _docstring_steps() != [(s, list(m)) for s, m in grade.STEPS]
    finally:
        grade.__doc__ = original
