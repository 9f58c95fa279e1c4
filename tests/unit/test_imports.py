"""Process boundaries: actors/ and learner/ never import each other; exgrpo_async/ imports neither."""

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
RULES = {"actors": {"learner"}, "learner": {"actors"}, "exgrpo_async": {"actors", "learner"}}
# The command line is the composition root: it starts a role through that role's main module (`eval`
# through actors.main.run_eval), and nothing else in exgrpo_async may name a role package.
COMPOSITION_ROOT = ROOT / "exgrpo_async" / "cli.py"


def imported_top_packages(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out.add(node.module.split(".")[0])
    return out


def role_modules(path: Path) -> set[str]:
    """Full module names of role-package imports in one file."""
    tree = ast.parse(path.read_text())
    mods = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module and n.level == 0}
    mods |= {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    return {m for m in mods if m.split(".")[0] in ("actors", "learner")}


@pytest.mark.parametrize("package", sorted(RULES))
def test_package_boundaries(package):
    files = list((ROOT / package).rglob("*.py"))
    assert files
    for f in files:
        if f == COMPOSITION_ROOT:
            assert role_modules(f) <= {"actors.main", "learner.main"}, "the CLI may only call the roles' main modules"
            continue
        bad = imported_top_packages(f) & RULES[package]
        assert not bad, f"{f.relative_to(ROOT)} imports {bad}"


def test_the_checker_sees_imports(tmp_path):
    f = tmp_path / "m.py"
    f.write_text("import learner.train\nfrom actors.loop import run\n")
    assert imported_top_packages(f) == {"learner", "actors"}
    assert role_modules(f) == {"learner.train", "actors.loop"}


def test_the_actor_loops_share_a_session_and_import_neither_other():
    """The batch loop picks the stream loop (one way); the stream loop takes what both need from
    actors/session.py, never from the batch loop."""
    stream = role_modules(ROOT / "actors" / "stream_loop.py")
    assert "actors.session" in stream and "actors.loop" not in stream
    assert not role_modules(ROOT / "actors" / "session.py") & {"actors.loop", "actors.stream_loop"}


def import_graph(root: Path, packages: tuple[str, ...]) -> dict[str, set[str]]:
    """Module -> the modules of `packages` it imports, anywhere in the file (inside functions too)."""
    files = {".".join(p.relative_to(root).with_suffix("").parts).removesuffix(".__init__"): p
             for pkg in packages for p in (root / pkg).rglob("*.py")}
    graph = {}
    for mod, path in files.items():
        names = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names |= {a.name for a in node.names}
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                names |= {node.module} | {f"{node.module}.{a.name}" for a in node.names}
        graph[mod] = {n for n in names if n in files and n != mod}
    return graph


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The import circles: each a list of modules, from one back to itself."""
    found, state = [], {}

    def visit(mod: str, path: list[str]) -> None:
        state[mod] = "open"
        for dep in sorted(graph[mod]):
            if state.get(dep) == "open":
                found.append(path[path.index(dep):] + [dep])
            elif dep not in state:
                visit(dep, path + [dep])
        state[mod] = "done"

    for mod in sorted(graph):
        if mod not in state:
            visit(mod, [mod])
    return found


def test_no_import_circle():
    assert circles(import_graph(ROOT, ("actors", "learner", "exgrpo_async"))) == []


def test_the_circle_check_sees_one(tmp_path):
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "a.py").write_text("def f():\n    from pkg.b import g\n")
    (tmp_path / "pkg" / "b.py").write_text("from pkg import a\n")
    (tmp_path / "pkg" / "c.py").write_text("import pkg.a\n")
    assert circles(import_graph(tmp_path, ("pkg",))) == [["pkg.a", "pkg.b", "pkg.a"]]


# learner/'s two layers (issue 50): the maths over tensors and the buffer, and the process shell that feeds it.
# ranks.py (the collectives the update and the selection pass call on several ranks) is neither.
LEARNER_MATHS = {"attention", "buffer", "compiled", "experience", "grpo", "loss_scale", "memory_model", "packing",
                 "replay", "update", "working_weights"}
LEARNER_SHELL = {"checkpoint", "dispatch", "fingerprints", "inbox", "main", "metrics", "model", "overlap", "policy",
                 "server", "shell", "step_metrics", "trackers", "train"}


def test_every_learner_module_is_in_one_layer():
    modules = {p.stem for p in (ROOT / "learner").glob("*.py")} - {"__init__", "ranks"}
    assert modules == LEARNER_MATHS | LEARNER_SHELL and not LEARNER_MATHS & LEARNER_SHELL, modules ^ (
        LEARNER_MATHS | LEARNER_SHELL)


def test_the_learners_maths_never_imports_its_shell():
    graph = import_graph(ROOT, ("learner",))
    for mod in sorted(LEARNER_MATHS):
        reached = {d.split(".")[1] for d in graph[f"learner.{mod}"] if "." in d}
        assert not reached & LEARNER_SHELL, f"learner/{mod}.py imports {reached & LEARNER_SHELL}"
