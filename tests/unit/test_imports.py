"""Process boundaries: actors/ and learner/ never import each other; exgrpo_async/ imports neither."""

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
RULES = {"actors": {"learner"}, "learner": {"actors"}, "exgrpo_async": {"actors", "learner"}}
# The command line is the composition root: it starts a role through that role's main module (`eval`
# through actors.main.run_eval), and nothing else in exgrpo_async may name a role package.
COMPOSITION_ROOT = ROOT / "exgrpo_async" / "launcher" / "cli.py"


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


# learner/'s two layers (issue 50), as its folders show them: learner/maths/ (the loss, log-probs, packing,
# attention, compiled regions, the update, the ExGRPO buffer, replay and experience: functions and small classes
# over tensors and the buffer) and the process shell around it in learner/ (main, train, shell, server, inbox,
# dispatch, policy, ranks, checkpoint, metrics, trackers). The maths imports nothing of the shell: it reduces
# over ranks through learner/maths/collectives.py's protocol, which learner/ranks.py implements.


def maths_reaching_the_shell(root: Path) -> dict[str, set[str]]:
    """learner/maths/ module -> the modules outside learner/maths/ (in learner/) it imports."""
    graph = import_graph(root, ("learner",))
    return {mod: {d for d in deps if not d.startswith("learner.maths")}
            for mod, deps in graph.items() if mod.startswith("learner.maths") and
            {d for d in deps if not d.startswith("learner.maths")}}


def test_the_learners_maths_never_imports_its_shell():
    assert len(list((ROOT / "learner" / "maths").glob("*.py"))) > 10
    assert maths_reaching_the_shell(ROOT) == {}


def test_the_layer_check_sees_a_reach_into_the_shell(tmp_path):
    (tmp_path / "learner" / "maths").mkdir(parents=True)
    (tmp_path / "learner" / "shell.py").write_text("from learner.maths import grpo\n")
    (tmp_path / "learner" / "maths" / "grpo.py").write_text("def f():\n    from learner.shell import run\n")
    assert maths_reaching_the_shell(tmp_path) == {"learner.maths.grpo": {"learner.shell"}}


def test_the_ranks_implement_the_maths_collectives():
    from learner.maths.collectives import SOLO, Collectives
    from learner.ranks import Ranks

    assert isinstance(Ranks(), Collectives) and isinstance(SOLO, Collectives)
    assert not isinstance(object(), Collectives)


# exgrpo_async/ in three parts (issue 50): the shared library (its top-level modules), the launcher and CLI
# (exgrpo_async/launcher/), the toy task and the report (exgrpo_async/toy/, exgrpo_async/report/). Only the
# command line reaches the launcher: no library module, learner or actor module imports it.
def launcher_importers(root: Path) -> set[str]:
    graph = import_graph(root, ("exgrpo_async", "learner", "actors"))
    return {mod for mod, deps in graph.items() if not mod.startswith("exgrpo_async.launcher")
            and any(d.startswith("exgrpo_async.launcher") for d in deps)}


def test_only_the_command_line_reaches_the_launcher():
    assert (ROOT / "exgrpo_async" / "launcher" / "train.py").exists()
    assert launcher_importers(ROOT) == set()


def test_the_launcher_check_sees_a_library_module_reach_it(tmp_path):
    for d in ("exgrpo_async/launcher", "learner", "actors"):
        (tmp_path / d).mkdir(parents=True)
    (tmp_path / "exgrpo_async" / "launcher" / "train.py").write_text("from exgrpo_async import runs\n")
    (tmp_path / "exgrpo_async" / "runs.py").write_text("def f():\n    from exgrpo_async.launcher.train import g\n")
    assert launcher_importers(tmp_path) == {"exgrpo_async.runs"}
