"""Load a benchmark script of ops/bench/ as a module (they are scripts, not a package), for the tests of
their figures: `load_bench("system/transport")` is ops/bench/system/transport.py. The script's group folder
goes on sys.path first, as Python puts it there for a script it runs, so that it imports its siblings."""

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

REPO = Path(__file__).resolve().parents[1]
BENCH = REPO / "ops" / "bench"


def load_bench(name: str) -> ModuleType:
    path = BENCH / f"{name}.py"
    if str(path.parent) not in sys.path:
        sys.path.insert(0, str(path.parent))
    spec = importlib.util.spec_from_file_location(f"bench_{name.replace('/', '_')}", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod
