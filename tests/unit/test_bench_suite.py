"""ops/bench/ as a suite: every benchmark script lives in one of the three groups (learning/, system/, gpu/),
begins with the shared helper's line and import (ops/bench/bench.py) and no private sys.path preamble, and
is named by a test under tests/ (a string in its code, not only its docstring: a path to run, or
`load_bench("GROUP/NAME")`). A script nothing tests fails here: give it a tiny run in a test, or remove it
and cite `git show COMMIT:ops/bench/...` beside its figures in the docs."""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
BENCH = REPO / "ops" / "bench"
GROUPS = ("learning", "system", "gpu")
HELPER_LINE = "sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # ops/bench/: bench.py, the shared helper"


def scripts() -> list[Path]:
    return sorted(p for p in BENCH.rglob("*.py") if p != BENCH / "bench.py")


def code_strings(path: Path) -> set[str]:
    """The string constants of a file's code, its docstrings left out."""
    tree = ast.parse(path.read_text())
    docs = {id(n.body[0].value) for n in ast.walk(tree)
            if isinstance(n, (ast.Module, ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and n.body
            and isinstance(n.body[0], ast.Expr) and isinstance(n.body[0].value, ast.Constant)}
    return {n.value for n in ast.walk(tree) if isinstance(n, ast.Constant) and isinstance(n.value, str)
            and id(n) not in docs}


def helper_problems(path: Path) -> list[str]:
    """What keeps a script from the shared preamble: the helper's line, then `import bench` or `from bench
    import ...` at module level, and no other sys.path change or repository root of its own."""
    text = path.read_text()
    lines = text.splitlines()
    problems = []
    if lines.count(HELPER_LINE) != 1:
        problems.append("the helper's sys.path line, once, as written in ops/bench/bench.py's docstring")
    if text.count("sys.path") != 1:
        problems.append("a sys.path change of its own")
    if "parents[2]" in text or "parents[3]" in text:
        problems.append("a repository root of its own (bench.REPO is the one)")
    tree = ast.parse(text)
    imports = [n.lineno for n in tree.body if (isinstance(n, ast.Import) and any(a.name == "bench" for a in n.names))
               or (isinstance(n, ast.ImportFrom) and n.module == "bench" and n.level == 0)]
    if not imports:
        problems.append("no module-level import of bench")
    elif HELPER_LINE in lines and min(imports) < lines.index(HELPER_LINE) + 1:
        problems.append("bench imported before the helper's line")
    return problems


def test_every_script_lives_in_a_group():
    assert scripts(), "no scripts found"
    outside = [str(p.relative_to(BENCH)) for p in scripts() if p.parent.parent != BENCH or p.parent.name not in GROUPS]
    assert not outside, f"ops/bench/ scripts outside {GROUPS}: {outside}"


def test_every_script_uses_the_shared_helper():
    bad = {str(p.relative_to(BENCH)): problems for p in scripts() if (problems := helper_problems(p))}
    assert not bad, bad


def test_every_script_is_named_by_a_test():
    strings = "\n".join(s for t in sorted((REPO / "tests").rglob("*.py")) if t != Path(__file__).resolve()
                        for s in code_strings(t))
    untested = [str(p.relative_to(BENCH)) for p in scripts() if str(p.relative_to(BENCH).with_suffix("")) not in strings]
    assert not untested, f"ops/bench/ scripts no test under tests/ names (GROUP/NAME in a string of its code): {untested}"


def test_the_checks_see_a_private_preamble_and_an_untested_script(tmp_path):
    """The checks themselves: a script with the old private preamble fails the helper's check, one nothing
    names fails the naming check's rule."""
    old = tmp_path / "old.py"
    old.write_text('"""x"""\nimport sys\nfrom pathlib import Path\n\nREPO = Path(__file__).resolve().parents[2]\n'
                   "sys.path.insert(0, str(REPO))\n")
    assert len(helper_problems(old)) == 3
    good = tmp_path / "good.py"
    good.write_text(f'"""x"""\nimport sys\nfrom pathlib import Path\n\n{HELPER_LINE}\nimport bench  # noqa: E402\n')
    assert helper_problems(good) == []
    named = tmp_path / "test_x.py"
    named.write_text('"""system/only_in_the_docstring"""\nX = "ops/bench/system/in_code.py"\n')
    assert code_strings(named) == {"ops/bench/system/in_code.py"}
