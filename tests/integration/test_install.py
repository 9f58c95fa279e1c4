"""A clean install: the wheel builds without a warning of our own, installs into a fresh venv and runs
outside the checkout (`--version`, `train --dry-run` on the embedded default, `config show`).

The fresh venv takes its dependencies (torch, vLLM, ...) from this checkout's venv through a path
line in a .pth file: such a line adds the folder to sys.path without running the .pth files inside
it, so the checkout's editable install of this project stays invisible and only the wheel is found.
"""

from __future__ import annotations

import json
import site
import subprocess
import sys
import sysconfig
from importlib.metadata import version
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_the_wheel_installs_and_runs_outside_the_checkout(tmp_path):
    build = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-w",
                            str(tmp_path / "dist"), str(REPO)], capture_output=True, text=True, timeout=300)
    assert build.returncode == 0, build.stderr[-3000:]
    assert "Warning" not in build.stdout + build.stderr and "deprecated" not in build.stdout + build.stderr
    (wheel,) = (tmp_path / "dist").glob("exgrpo_async-*.whl")

    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    py = venv / "bin" / "python"
    purelib = Path(subprocess.run([py, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                                  capture_output=True, text=True, check=True).stdout.strip())
    deps = [p for p in {sysconfig.get_paths()["purelib"], *site.getsitepackages()} if Path(p).is_dir()]
    (purelib / "checkout-deps.pth").write_text("".join(p + "\n" for p in deps))
    install = subprocess.run([sys.executable, "-m", "pip", "--python", str(py), "install", "--no-deps", "-q",
                              str(wheel)], capture_output=True, text=True, timeout=300)
    assert install.returncode == 0, install.stderr[-3000:]

    run = lambda *args: subprocess.run([venv / "bin" / "exgrpo-async", *args], capture_output=True,  # noqa: E731
                                       text=True, cwd=tmp_path, timeout=300)
    where = subprocess.run([py, "-c", "import exgrpo_async, actors, learner; print(exgrpo_async.__file__, "
                            "actors.__file__, learner.__file__)"], capture_output=True, text=True, cwd=tmp_path,
                           check=True).stdout.split()
    assert all(Path(w).is_relative_to(purelib) for w in where), where  # the wheel's copy, not the checkout
    assert run("--version").stdout.strip() == f"exgrpo-async {version('exgrpo-async')}"
    dry = run("train", "--dry-run", "learner.max_steps=2")
    assert dry.returncode == 0, dry.stderr[-3000:]
    resolved = json.loads(dry.stdout[:dry.stdout.rindex("}") + 1])
    assert resolved["learner"]["max_steps"] == 2 and resolved["actor"]["num_actors"] >= 1
    shown = run("config", "show")
    assert shown.returncode == 0 and "[learner]" in shown.stdout
