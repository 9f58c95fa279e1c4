"""The warm-started toy policy the package ships, so that a new user's demo skips the SFT.

The demo's recipe (toy seed 0, 600 SFT steps: ToyConfig's defaults) is built by `ops/toy-policy build`
in a mode that gives the same bits on any x86-64 CPU: torch's kernels at their portable level
(`ATEN_CPU_CAPABILITY=default`) and MKL's conditional numerical reproducibility (`MKL_CBWR=COMPATIBLE`),
so the result depends neither on the CPU's vector width nor on the thread count (REPRODUCIBLE_ENV).
The weights (4 MB) and a manifest (shipped.json: the recipe key, the weights' sha256, the torch that
built them, the warm start's held-out accuracy) live in exgrpo_async/toy/policy/; the tokenizer and the
task files are made again at install, by the same code. `ops/toy-policy build|check` (exgrpo_async/
toy/rebuild.py) builds the policy, or rebuilds it and compares bit for bit.

`toy.ensure_toy_assets` installs the shipped policy when the asked recipe's key equals the manifest's.
The key hashes the source of every function that makes the policy (toy.RECIPE): change one and the
demo builds its own again, and tests/unit/test_toy_shipped.py fails until the policy is rebuilt.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path
from typing import Callable

SHIPPED = Path(__file__).resolve().parent / "policy"
REPRODUCIBLE_ENV = {"ATEN_CPU_CAPABILITY": "default", "MKL_CBWR": "COMPATIBLE"}
FILES = ("model.safetensors", "config.json", "generation_config.json")
SEED, SFT_STEPS = 0, 600


class ShippedPolicyError(RuntimeError):
    """The shipped files do not match their manifest (a damaged install)."""


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def manifest(folder: Path = SHIPPED) -> dict | None:
    """The shipped policy's manifest, or None when this install has none."""
    path = folder / "shipped.json"
    return json.loads(path.read_text()) if path.exists() else None


def matches(key: str, folder: Path = SHIPPED) -> bool:
    """Whether the shipped policy is the one the recipe with this key makes."""
    m = manifest(folder)
    return m is not None and m["key"] == key


def install(model_dir: Path, sft_json: Path, write_tokenizer: Callable[[Path], None], folder: Path = SHIPPED) -> None:
    """Write the shipped policy (weights checked against the manifest) and its tokenizer (`write_tokenizer`,
    the toy's own: exgrpo_async/toy/task.py) to `model_dir`, and the warm start's summary to `sft_json`."""
    m = manifest(folder)
    if m is None:
        raise ShippedPolicyError(f"no shipped toy policy in {folder}")
    got = sha256(folder / "model.safetensors")
    if got != m["sha256"]:
        raise ShippedPolicyError(f"{folder / 'model.safetensors'}: sha256 {got[:16]}... is not the manifest's "
                                 f"{m['sha256'][:16]}... (a damaged install: reinstall the package, or rebuild "
                                 "it with ops/toy-policy build)")
    model_dir.mkdir(parents=True, exist_ok=True)
    write_tokenizer(model_dir)
    for name in FILES:
        shutil.copyfile(folder / name, model_dir / name)
    sft_json.write_text(json.dumps(dict(m["sft"], shipped=True, key=m["key"])))
    print(f"[toy] installed the shipped warm-started policy ({m['key']}; held-out greedy "
          f"{m['sft']['greedy_accuracy']:.3f}, sampled {m['sft']['sampled_accuracy']:.3f})", flush=True)
