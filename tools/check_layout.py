"""Check the package's layout rules; print each breach and exit 1 if there is one.

    python tools/check_layout.py

1. No ddplab module imports another module's private (``_name``) name, or
   reads one from a module it imported (``cluster._current``). A private
   module (``check/_core.py``) is private to its package: its siblings use it.
2. One process owner: only ``ddplab.procs`` (``ddplab/procs.py``, or the
   ``ddplab/procs/`` package) signals or kills processes (``os.kill``,
   ``os.killpg``, ``.kill()``, ``.terminate()``), in the package and in the
   tests, tools and benchmarks alike.
3. ...and only ``ddplab.procs`` starts them with ``Popen``: everything else in
   ddplab runs its commands through ``procs.Group`` (or ``procs.start``), so
   one set of rules starts, watches and ends them. Found in the code, not the
   words: ``subprocess.Popen`` (any ``.Popen``), ``from subprocess import
   Popen``, or the name ``Popen``; a docstring or comment that names it is fine.
4. ``ddplab/rank/`` (code that runs inside an engine) never imports the
   kernel-side ``ddplab.lab``, not even inside a function.
5. No import cycle among ddplab's modules, counting imports inside functions
   too (a package's ``__init__`` counts as its own module).
6. Nothing in ddplab derives from ``Lab``: a lab is composed from a ``Ranks``
   and a ``Calls`` (``ddplab.lab.lab``), and a new kind of lab is a new
   ``Ranks``, so no subclass reaches into ``Lab``'s private state.
7. The top level is public: the top-level modules of ddplab (``ddplab/*.py``)
   are exactly the teaching modules that ``ddplab/__init__.py``'s docstring
   lists in its ``Teaching modules`` paragraph (each name in double
   backquotes, up to the next blank line), which notebooks may import, plus
   ``__init__``, ``__main__``, the small shared infrastructure
   (``INFRASTRUCTURE``) and ``procs`` where it is a module. A new top-level
   module is listed there, or lives in the package that uses it. A listed
   name may be a package (``ddplab/plan/``: a teaching module in steps).
8. No ddplab module, and no file under ``tests/``, is longer than ``MAX_LINES``
   (450) lines: split it by what it does (a test module by what its tests are
   about, with what the parts share in a helper module beside them).
9. Only ``ddplab.procs`` runs a command to its end with ``subprocess``
   (``run``, ``call``, ``check_call``, ``check_output``, ``getoutput``,
   ``getstatusoutput``): everything else in ddplab calls ``procs.run_command``.
   Found in the code: ``subprocess.run(...)`` (under any name the module was
   imported as) or ``from subprocess import run``.
10. ``ddplab/check/`` is cut by notebook: each of its public modules (or
   packages) is named ``nb`` + a notebook's file name, ``nb01_point_to_point``
   for ``notebooks/01_point_to_point.ipynb``, and holds that notebook's
   checkers; every notebook has one; ``check/__init__.py``'s ``NOTEBOOKS``
   lists exactly those, in course order (the one list ``__all__`` is built
   from). What several notebooks share is private (``_core``, ``_feedback``).

11. A name stands once under ddplab/: no two modules (nor a module and a package) share a
    name in different folders, so a name says which room it is in (``hosts.py`` beside
    ``lab/hosts/`` made readers import one ``as placing``). ``TWINS`` lists the names that
    stand twice on purpose, each with its reason: the kernel's and the rank's side of one
    mechanism (``lab/flight.py``, ``rank/flight.py``), and the twins other work renames.
12. What notebooks import is the public API: every ``import ddplab...`` and ``from ddplab...
    import`` in a code cell of ``notebooks/*.ipynb`` (inside a function too) names ``ddplab``,
    a teaching module (rule 7's list), or ``ddplab.check``; a deeper module only where
    ``NOTEBOOK_IMPORTS`` lists it, with its reason. A top-level module is teaching or
    infrastructure, never both.

Imports under ``if TYPE_CHECKING:`` never run, so rules 1, 4 and 5 skip them.
"""

from __future__ import annotations

import ast
import json
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = "ddplab"
PROCESS_MODULE = f"{PACKAGE}.procs"
KILLERS = {("os", "kill"), ("os", "killpg")}
KILL_METHODS = {"kill", "terminate"}
STARTER = "Popen"
RANK_PACKAGE, KERNEL_PACKAGE = f"{PACKAGE}.rank", f"{PACKAGE}.lab"
COMPOSED = "Lab"     # the class that is composed, never subclassed (rule 6)
INFRASTRUCTURE = ("__init__", "__main__", "errors", "limits", "text")   # rule 7
#: Rule 10: the names that stand twice under ddplab/ on purpose, and why.
TWINS = {
    "__main__": "python -m's entry points: the ddplab command's, and ddplab.plan's",
    "debugger": "one mechanism's two sides: the kernel's (lab/) serves what the rank's (rank/) asks",
    "flight": "one mechanism's two sides: the kernel asks (lab/), the rank's thread answers (rank/)",
    "live": "one mechanism's two sides: the rank publishes its screen (rank/), the kernel shows it",
    "template": "one mechanism's two sides: the launcher the kernel plugs in (lab/), the process "
                "that forks the engines (rank/)",
    "trace": "lab.trace()'s two sides: the package the notebook holds, and the rank's recording",
    "lab": "the kernel side's package and its Lab's module (lab/lab.py), as torch.nn.modules.module",
    "memory": "memory.py is notebook 11's teaching module; plan/memory.py is a plan's step 1, "
              "which notebook 15 imports (the planner's to rename, with ddplab.plan's steps)",
    "report": "grade/report.py and plan/report.py, each the last step of its package's pipeline "
              "(the grading's and the planner's owners decide)",
}
#: Rule 11: the notebook imports of deeper modules that other work moves, and why each stands.
NOTEBOOK_IMPORTS = {
    "ddplab.plan.models": "notebook 15: a plan's steps, imported by name (the planner's)",
    "ddplab.plan.memory": "notebook 15: a plan's steps, imported by name (the planner's)",
    "ddplab.plan.compute": "notebook 15: a plan's steps, imported by name (the planner's)",
    "ddplab.plan.flops": "notebook 15: a plan's steps, imported by name (the planner's)",
    "ddplab.check.nb10_checkpoints_and_failures": "notebook 10's reference save and load, its "
        "checker's own (moving references off the student's path is issue 59 item 6, not done)",
}
NOTEBOOKS = "notebooks"
TEACHING = "Teaching modules"    # the paragraph of ddplab/__init__'s docstring that lists them
MAX_LINES = 450                  # rule 8
TESTS = "tests"                  # rule 8 holds there too
RUNNERS = {"run", "call", "check_call", "check_output", "getoutput", "getstatusoutput"}  # rule 9
CHECKERS, NOTEBOOK_PREFIX = "check", "nb"                                    # rule 10


def within(name: str, package: str) -> bool:
    """Whether module ``name`` is ``package`` or one of its submodules."""
    return name == package or name.startswith(package + ".")


def module_name(path: Path, root: Path = ROOT) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def package_of(name: str, path: Path) -> str:
    return name if path.name == "__init__.py" else name.rpartition(".")[0]


def modules(root: Path = ROOT) -> dict[str, Path]:
    return {module_name(p, root): p for p in sorted((root / PACKAGE).rglob("*.py"))}


def resolve(node: ast.ImportFrom, package: str) -> str:
    """The absolute module an ``from X import ...`` names."""
    if not node.level:
        return node.module or ""
    base = package.split(".")
    base = base[:len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def _type_checking_lines(tree: ast.AST) -> set[int]:
    """Lines under ``if TYPE_CHECKING:`` (imports there never run)."""
    lines = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and getattr(node.test, "id", "") == "TYPE_CHECKING":
            for child in node.body:
                lines.update(range(child.lineno, (child.end_lineno or child.lineno) + 1))
    return lines


class Module:
    """One ddplab module: what it imports, and the names it binds to ddplab modules."""

    def __init__(self, name: str, path: Path, known: dict[str, Path]) -> None:
        self.name, self.path = name, path
        self.package = package_of(name, path)
        self.tree = ast.parse(path.read_text(), str(path))
        self.imports: dict[str, int] = {}        # module -> first line
        self.aliases: dict[str, str] = {}        # local name -> ddplab module
        self.private: list[tuple[int, str]] = []
        skip = _type_checking_lines(self.tree)
        for node in ast.walk(self.tree):
            if getattr(node, "lineno", 0) in skip:
                continue
            if isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.name.split(".")[0] == PACKAGE:
                        self._use(alias.name, node.lineno)
                        self._check_module(alias.name, node.lineno)
                        if alias.asname:
                            self.aliases[alias.asname] = alias.name
            elif isinstance(node, ast.ImportFrom):
                source = resolve(node, self.package)
                if source.split(".")[0] != PACKAGE:
                    continue
                self._check_module(source, node.lineno)
                for alias in node.names:
                    target = f"{source}.{alias.name}"
                    if target in known:          # a submodule: from . import cluster
                        self._use(target, node.lineno)
                        self.aliases[alias.asname or alias.name] = target
                        self._check_module(target, node.lineno)
                    else:
                        self._use(source, node.lineno)
                        if _private(alias.name) and source != self.name:
                            self.private.append((node.lineno,
                                                 f"imports private name {alias.name} of {source}"))
        for node in ast.walk(self.tree):
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and \
                    node.value.id in self.aliases and _private(node.attr):
                owner = self.aliases[node.value.id]
                if owner != self.name:
                    self.private.append((node.lineno, f"reads private {owner}.{node.attr}"))

    def _check_module(self, target: str, line: int) -> None:
        """A private module (``pkg._core``) may be imported only from within its package."""
        parts = target.split(".")
        for i, part in enumerate(parts):
            parent = ".".join(parts[:i])
            if _private(part) and not (self.package == parent or
                                       self.package.startswith(parent + ".")):
                self.private.append((line, f"imports private module {'.'.join(parts[:i + 1])}"))
                return

    def _use(self, target: str, line: int) -> None:
        if target != self.name:
            self.imports.setdefault(target, line)


def kill_calls(path: Path) -> list[tuple[int, str]]:
    """Calls that signal a process: ``os.kill``, ``os.killpg``, ``x.kill()``, ``x.terminate()``."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            owner = node.func.value
            name = node.func.attr
            if isinstance(owner, ast.Name) and (owner.id, name) in KILLERS:
                found.append((node.lineno, f"{owner.id}.{name}()"))
            elif name in KILL_METHODS:
                found.append((node.lineno, f".{name}()"))
    return found


def popen_uses(path: Path) -> list[tuple[int, str]]:
    """Code that names ``Popen``: ``x.Popen``, ``from m import Popen``, a bare ``Popen``."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Attribute) and node.attr == STARTER:
            found.append((node.lineno, f"{ast.unparse(node)}"))
        elif isinstance(node, ast.ImportFrom) and any(a.name == STARTER for a in node.names):
            found.append((node.lineno, f"from {node.module} import {STARTER}"))
        elif isinstance(node, ast.Name) and node.id == STARTER:
            found.append((node.lineno, STARTER))
    return sorted(set(found))


def subprocess_runs(path: Path) -> list[tuple[int, str]]:
    """Code that runs a command through ``subprocess`` rather than ``procs``: ``subprocess.run(...)``
    (``import subprocess as sp``: ``sp.run``), ``from subprocess import run``."""
    tree = ast.parse(path.read_text(), str(path))
    names = {alias.asname or alias.name for node in ast.walk(tree) if isinstance(node, ast.Import)
             for alias in node.names if alias.name == "subprocess"}
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr in RUNNERS and \
                isinstance(node.value, ast.Name) and node.value.id in names:
            found.append((node.lineno, ast.unparse(node)))
        elif isinstance(node, ast.ImportFrom) and node.module == "subprocess":
            found += [(node.lineno, f"from subprocess import {a.name}") for a in node.names
                      if a.name in RUNNERS]
    return sorted(set(found))


def subclasses_of_composed(path: Path) -> list[tuple[int, str]]:
    """Classes whose bases name ``Lab`` (``Lab``, ``lab.Lab``, ``ddplab.Lab``)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ClassDef):
            for base in node.bases:
                named = base.attr if isinstance(base, ast.Attribute) else getattr(base, "id", "")
                if named == COMPOSED:
                    found.append((node.lineno, f"class {node.name}({ast.unparse(base)})"))
    return found


def listed_teaching_modules(init: Path) -> list[str] | None:
    """The ``names`` in the ``Teaching modules`` paragraph of ``init``'s docstring (None: no such
    paragraph)."""
    doc = ast.get_docstring(ast.parse(init.read_text(), str(init))) or ""
    start = doc.find(TEACHING)
    if start < 0:
        return None
    paragraph = doc[start:].split("\n\n", 1)[0]
    return re.findall(r"``(\w+)``", paragraph)


def top_level_problems(root: Path) -> list[str]:
    """Rule 7: the top-level modules are the listed teaching modules and the infrastructure."""
    init = root / PACKAGE / "__init__.py"
    rel = init.relative_to(root)
    listed = listed_teaching_modules(init)
    if listed is None:
        return [f"{rel}: its docstring has no {TEACHING!r} paragraph listing the top-level "
                f"modules that notebooks may import (``name``, ``name``, ...)"]
    present = {p.stem for p in (root / PACKAGE).glob("*.py")}
    allowed = set(listed) | set(INFRASTRUCTURE) | {PROCESS_MODULE.rpartition(".")[2]}
    out = [f"{PACKAGE}/{name}.py: a top-level module that {rel}'s docstring does not list among "
           f"its {TEACHING}: list it there if notebooks import it, else move it into the package "
           f"that uses it" for name in sorted(present - allowed)]
    packages = {p.parent.name for p in (root / PACKAGE).glob("*/__init__.py")}   # plan/: a teaching package
    out += [f"{rel}: its docstring lists {name!r} among its {TEACHING}, but there is no "
            f"{PACKAGE}/{name}.py" for name in sorted(set(listed) - present - packages)]
    return out


def twins(root: Path) -> list[str]:
    """Rule 10: names that stand twice (modules, and packages) under ddplab/, unless in ``TWINS``."""
    where: dict[str, list[str]] = {}
    for path in sorted((root / PACKAGE).rglob("*.py")):
        rel = path.relative_to(root)
        if path.name == "__init__.py":
            if path.parent != root / PACKAGE:
                where.setdefault(path.parent.name, []).append(f"{rel.parent}/")
        else:
            where.setdefault(path.stem, []).append(str(rel))
    return [f"{' and '.join(places)}: one name in two folders; rename one so the name says which "
            f"room it is in, or list it in TWINS with the reason"
            for name, places in sorted(where.items()) if len(places) > 1 and name not in TWINS]


def _cell_imports(source: str) -> list[tuple[str, list[str]]]:
    """The ``(module, names)`` of each ``ddplab`` import in a notebook cell's source: ``names``
    is ``[]`` for ``import ddplab.x``. IPython's magics and shell lines are read as comments."""
    lines = [f"{line[:len(line) - len(line.lstrip())]}pass  # {line.lstrip()}"
             if line.lstrip().startswith(("%", "!")) else line for line in source.splitlines()]
    try:
        tree = compile("\n".join(lines), "<cell>", "exec",
                       ast.PyCF_ONLY_AST | ast.PyCF_ALLOW_TOP_LEVEL_AWAIT)
    except SyntaxError:
        return [(m[1], [n.split(" as ")[0].strip() for n in m[2].strip("() ").split(",")])
                for m in re.finditer(r"^\s*from\s+(ddplab[\w.]*)\s+import\s+(.+)$", source, re.M)]
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(a.name, []) for a in node.names if a.name.split(".")[0] == PACKAGE]
        elif isinstance(node, ast.ImportFrom) and not node.level and \
                (node.module or "").split(".")[0] == PACKAGE:
            found.append((node.module, [a.name for a in node.names]))
    return found


def notebook_problems(root: Path) -> list[str]:
    """Rule 11: notebooks import ddplab, its teaching modules and ``ddplab.check``, no deeper."""
    teaching = listed_teaching_modules(root / PACKAGE / "__init__.py") or []
    public = {PACKAGE, f"{PACKAGE}.check"} | {f"{PACKAGE}.{name}" for name in teaching}
    known = modules(root)
    out = []
    for notebook in sorted((root / NOTEBOOKS).glob("*.ipynb")):
        cells = json.loads(notebook.read_text()).get("cells", [])
        for index, cell in enumerate(cells):
            if cell.get("cell_type") != "code":
                continue
            source = cell["source"] if isinstance(cell["source"], str) else "".join(cell["source"])
            for module, names in _cell_imports(source):
                # ``from ddplab.x import y`` imports the module ddplab.x.y where there is one.
                targets = [f"{module}.{n}" if f"{module}.{n}" in known else module
                           for n in names] or [module]
                out += [f"{notebook.relative_to(root)}: cell {index} imports {target}, which is "
                        f"not ddplab's public API (ddplab, a teaching module that "
                        f"{PACKAGE}/__init__.py's docstring lists, or {PACKAGE}.check): import "
                        f"it from a teaching module, or move what it needs into one"
                        for target in dict.fromkeys(targets)
                        if target not in public and target not in NOTEBOOK_IMPORTS]
    both = sorted(set(teaching) & set(INFRASTRUCTURE))
    out += [f"{PACKAGE}/{name}.py: listed both as a teaching module and as infrastructure: it is "
            f"one or the other" for name in both]
    return out


def too_long(path: Path) -> str | None:
    """Rule 8: ``path`` has more than ``MAX_LINES`` lines."""
    lines = len(path.read_text().splitlines())
    return f"{lines} lines, over the cap of {MAX_LINES}: split it by what it does" \
        if lines > MAX_LINES else None


def _listed_notebooks(init: Path) -> list[str] | None:
    """The names in ``check/__init__.py``'s ``NOTEBOOKS = (...)`` (None: no such tuple)."""
    for node in ast.parse(init.read_text(), str(init)).body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", "") == "NOTEBOOKS" for t in node.targets):
            try:
                return list(ast.literal_eval(node.value))
            except ValueError:
                return None
    return None


def checker_problems(root: Path) -> list[str]:
    """Rule 10: the checkers are cut by notebook, and ``NOTEBOOKS`` lists them in course order."""
    folder = root / PACKAGE / CHECKERS
    if not folder.is_dir():
        return []
    notebooks = sorted(p.stem for p in (root / "notebooks").glob("[0-9]*.ipynb"))
    wanted = [NOTEBOOK_PREFIX + stem for stem in notebooks]
    present = sorted({p.stem for p in folder.glob("*.py")}
                     | {p.parent.name for p in folder.glob("*/__init__.py")})
    rel = folder.relative_to(root)
    out = [f"{rel}/{name}: a public checker module not named for a notebook ({NOTEBOOK_PREFIX} + a "
           f"notebook's file name, e.g. {wanted[0] if wanted else 'nb01_point_to_point'}): move its "
           f"checkers into their notebook's module, or make it private (_{name}) if several share it"
           for name in present if not name.startswith("_") and name not in wanted]
    out += [f"{rel}: no checker module for notebooks/{name[len(NOTEBOOK_PREFIX):]}.ipynb (add "
            f"{rel}/{name}.py and list it in NOTEBOOKS)" for name in wanted if name not in present]
    listed = _listed_notebooks(folder / "__init__.py")
    if listed is None:
        out.append(f"{rel}/__init__.py: no NOTEBOOKS = (...) tuple of the notebooks' checker modules")
    elif listed != wanted:
        out.append(f"{rel}/__init__.py: NOTEBOOKS must list every notebook's checker module, in course "
                   f"order: {', '.join(wanted)}; it lists {', '.join(listed)}")
    return out


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Every strongly connected group of more than one module (Tarjan), as a sorted list."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    groups: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in graph.get(node, ()):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            group = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                group.append(member)
                if member == node:
                    break
            if len(group) > 1:
                groups.append(sorted(group))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return sorted(groups)


def problems(root: Path = ROOT) -> list[str]:
    """Every breach of the rules under ``root`` (a checkout), one line each."""
    known = modules(root)
    parsed = {name: Module(name, path, known) for name, path in known.items()}
    out = []
    for module in parsed.values():
        rel = module.path.relative_to(root)
        out += [f"{rel}:{line}: {what}" for line, what in module.private]
        out += [f"{rel}:{line}: {what} derives from {COMPOSED}: compose a lab from a Ranks "
                f"instead (ddplab.lab.ranks)" for line, what in subclasses_of_composed(module.path)]
        long = too_long(module.path)
        if long:
            out.append(f"{rel}: {long}")
        if within(module.name, PROCESS_MODULE):
            continue
        out += [f"{rel}:{line}: {what} outside {PROCESS_MODULE}: run commands with "
                f"ddplab.procs.Group (or procs.start)" for line, what in popen_uses(module.path)]
        out += [f"{rel}:{line}: {what} outside {PROCESS_MODULE}: run a short command to its "
                f"end with ddplab.procs.run_command" for line, what in subprocess_runs(module.path)]
        if within(module.name, RANK_PACKAGE):
            out += [f"{rel}:{line}: imports {target}: code under {RANK_PACKAGE} runs in an "
                    f"engine and never imports the kernel-side {KERNEL_PACKAGE}"
                    for target, line in sorted(module.imports.items(), key=lambda t: t[1])
                    if within(target, KERNEL_PACKAGE)]
    for path in sorted((root / TESTS).rglob("*.py")):
        long = too_long(path)
        if long:
            out.append(f"{path.relative_to(root)}: {long}")
    for folder in (PACKAGE, TESTS, "tools", "benchmarks"):
        for path in sorted((root / folder).rglob("*.py")):
            if folder == PACKAGE and within(module_name(path, root), PROCESS_MODULE):
                continue
            rel = path.relative_to(root)
            out += [f"{rel}:{line}: {what} outside {PROCESS_MODULE}: use ddplab.procs"
                    for line, what in kill_calls(path)]
    out += top_level_problems(root)
    out += twins(root)
    out += notebook_problems(root)
    out += checker_problems(root)
    graph = {name: {t for t in m.imports if t in known} for name, m in parsed.items()}
    for group in cycles(graph):
        edges = [f"{a} -> {b} (line {parsed[a].imports[b]})" for a in group for b in group
                 if b in graph[a]]
        out.append("import cycle: " + "; ".join(edges))
    return out


def main() -> int:
    found = problems()
    for line in found:
        print(line)
    if found:
        print(f"{len(found)} layout problem(s).", file=sys.stderr)
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
