"""The codebase stays readable in one sitting: these are the measurements of that, checked on every
run of the suite. The story (train_grpo.py) passes named things: no *tuple splats and at most 5
positional parameters per function. No core file is over 450 non-blank lines, no benchmark script
over 400, no module docstring over 15 lines, and README stays under 300 lines and BENCHMARKS.md under 25 KB. Neither code nor
README cites issue numbers or work sessions: they say why, and the history lives in docs/LOG.md.
Imports only go down: no two modules import each other, directly or through others."""

import ast
import glob
import os
import re

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CORE = sorted(glob.glob(os.path.join(REPO, "*.py")) + glob.glob(os.path.join(REPO, "tasks", "*.py")))
BENCHMARKS = sorted(glob.glob(os.path.join(REPO, "benchmarks", "*.py")))


def non_blank(path):
    with open(path) as f:
        return sum(1 for line in f if line.strip())


def name(path):
    return os.path.relpath(path, REPO)


@pytest.mark.parametrize("path", CORE, ids=name)
def test_core_files_are_at_most_450_non_blank_lines(path):
    assert non_blank(path) <= 450, f"{name(path)}: {non_blank(path)} non-blank lines; split the idea it holds"


@pytest.mark.parametrize("path", BENCHMARKS, ids=name)
def test_benchmark_scripts_are_at_most_400_non_blank_lines(path):
    assert non_blank(path) <= 400, f"{name(path)}: {non_blank(path)} non-blank lines; share helpers via a module"


@pytest.mark.parametrize("path", CORE + BENCHMARKS, ids=name)
def test_module_docstrings_are_short(path):
    doc = ast.get_docstring(ast.parse(open(path).read())) or ""
    assert len(doc.splitlines()) <= 15, f"{name(path)}: a {len(doc.splitlines())}-line module docstring"


def test_the_story_passes_named_things():
    tree = ast.parse(open(os.path.join(REPO, "train_grpo.py")).read())
    splats = [n.lineno for n in ast.walk(tree) if isinstance(n, ast.Call) for a in n.args if isinstance(a, ast.Starred)]
    assert not splats, f"train_grpo.py: *splat calls at lines {splats}: pass named arguments"
    wide = [
        (f.name, len(f.args.posonlyargs) + len(f.args.args))
        for f in ast.walk(tree)
        if isinstance(f, ast.FunctionDef) and len(f.args.posonlyargs) + len(f.args.args) > 5
    ]
    assert not wide, f"train_grpo.py: functions with more than 5 positional parameters: {wide}"


def test_benchmarks_md_is_a_summary():
    """BENCHMARKS.md is one table of the current figures, each with its command and a page under
    docs/benchmarks/ that holds the detail: at most 25 KB, and every page it names exists."""
    text = open(FIGURES[0]).read()
    assert len(text.encode()) <= 25_000
    pages = set(re.findall(r"\(docs/benchmarks/([\w.-]+\.md)", text))
    assert pages and all(os.path.isfile(os.path.join(REPO, "docs", "benchmarks", p)) for p in pages), pages


def test_readme_is_at_most_300_lines():
    with open(os.path.join(REPO, "README.md")) as f:
        assert len(f.readlines()) <= 300


FIGURES = [os.path.join(REPO, "BENCHMARKS.md")] + sorted(glob.glob(os.path.join(REPO, "docs", "benchmarks", "*.md")))


@pytest.mark.parametrize("path", CORE + BENCHMARKS + FIGURES + [os.path.join(REPO, "README.md")], ids=name)
def test_no_issue_or_session_references(path):
    text = open(path).read()
    refs = re.findall(r"\b(?:issues? \d+|session[- ]\d+)", text, flags=re.IGNORECASE)
    assert not refs, f"{name(path)}: {refs}: say why instead; history goes to docs/LOG.md"


def import_cycles(root):
    """The import cycles among the top-level modules and tasks/ under `root`: each strongly connected
    component of more than one module (Tarjan), sorted. An import anywhere in a file counts, a function's
    own included: a lazy import hides a cycle from Python, not from a reader."""
    paths = glob.glob(os.path.join(root, "*.py")) + glob.glob(os.path.join(root, "tasks", "*.py"))
    modules = {os.path.relpath(p, root)[:-3].replace(os.sep, "."): p for p in paths}
    edges = {m: set() for m in modules}
    for m, path in modules.items():
        for node in ast.walk(ast.parse(open(path).read())):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]  # from tasks import math
            else:
                continue
            edges[m] |= {n for n in names if n in modules and n != m}
    index, low, stack, cycles = {}, {}, [], []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in edges[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = stack[stack.index(v) :]
            del stack[stack.index(v) :]
            if len(component) > 1:
                cycles.append(sorted(component))

    for v in sorted(modules):
        if v not in index:
            visit(v)
    return sorted(cycles)


def test_imports_only_go_down():
    cycles = import_cycles(REPO)
    assert not cycles, (
        f"import cycles (each module imports another of its group, at the top or in a function): {cycles}"
    )


def project_imports(path):
    """The project's modules that a file imports, at the top or in a function."""
    modules = {name(p)[:-3].replace(os.sep, ".") for p in CORE}
    found = set()
    for node in ast.walk(ast.parse(open(path).read())):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.add(node.module)
    return found & modules


def test_the_flags_import_no_feature_module():
    """config.py sits low in the house, so every feature may read Args: the rules of each flag live with
    the flags (flag_rules.py, bands.py), and what an error tells the user (user_errors.py) is below them."""
    below = {"flag_rules", "bands", "user_errors"}
    assert project_imports(os.path.join(REPO, "config.py")) <= below
    for module in below:
        assert not project_imports(os.path.join(REPO, f"{module}.py")), module


def main_function(path):
    tree = ast.parse(open(path).read())
    return next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "main")


def test_the_training_loop_never_asks_where_rollouts_come_from():
    """train_grpo.main's loop takes each step's rollout from the rollout source, `rollouts` (rollout_source.py), and
    names no placement: a new placement is a new source, and no line of the loop changes. main itself stays
    a story one reads in one sitting: at most 150 non-blank lines, in a file of at most 380."""
    path = os.path.join(REPO, "train_grpo.py")
    main = main_function(path)
    loop = next(n for n in ast.walk(main) if isinstance(n, ast.For))
    names = {n.id for n in ast.walk(loop) if isinstance(n, ast.Name)}
    assert not names & {"placement", "remote", "engine", "ahead", "rollout_ranks", "stream_rollouts"}, names
    assert "rollouts" in names
    lines = open(path).read().splitlines()[main.lineno - 1 : main.end_lineno]
    assert sum(1 for line in lines if line.strip()) <= 150
    assert non_blank(path) <= 380
