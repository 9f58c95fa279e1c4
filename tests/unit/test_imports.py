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
