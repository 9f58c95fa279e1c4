"""The warm-started toy policy the package ships, so that a new user's demo skips the SFT.

The demo's recipe (toy seed 0, 600 SFT steps: ToyConfig's defaults) is built by `ops/toy-policy build`
in a mode that gives the same bits on any x86-64 CPU: torch's kernels at their portable level
(`ATEN_CPU_CAPABILITY=default`) and MKL's conditional numerical reproducibility (`MKL_CBWR=COMPATIBLE`),
so the result depends neither on the CPU's vector width nor on the thread count (REPRODUCIBLE_ENV).
The weights (4 MB) and a manifest (shipped.json: the recipe key, the weights' sha256, the torch that
built them, the warm start's held-out accuracy) live in exgrpo_async/toy_policy/; the tokenizer and the
task files are made again at install, by the same code. `ops/toy-policy check` rebuilds the policy and
compares it bit for bit.

`toy.ensure_toy_assets` installs the shipped policy when the asked recipe's key equals the manifest's.
The key hashes the source of every function that makes the policy (toy.RECIPE): change one and the
demo builds its own again, and tests/unit/test_toy_shipped.py fails until the policy is rebuilt.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

SHIPPED = Path(__file__).resolve().parent / "toy_policy"
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


def install(model_dir: Path, sft_json: Path, folder: Path = SHIPPED) -> None:
    """Write the shipped policy (weights checked against the manifest) and its tokenizer to `model_dir`,
    and the warm start's summary to `sft_json`."""
    from exgrpo_async.toy import build_tokenizer

    m = manifest(folder)
    if m is None:
        raise ShippedPolicyError(f"no shipped toy policy in {folder}")
    got = sha256(folder / "model.safetensors")
    if got != m["sha256"]:
        raise ShippedPolicyError(f"{folder / 'model.safetensors'}: sha256 {got[:16]}... is not the manifest's "
                                 f"{m['sha256'][:16]}... (a damaged install: reinstall the package, or rebuild "
                                 "it with ops/toy-policy build)")
    model_dir.mkdir(parents=True, exist_ok=True)
    build_tokenizer(model_dir)
    for name in FILES:
        shutil.copyfile(folder / name, model_dir / name)
    sft_json.write_text(json.dumps(dict(m["sft"], shipped=True, key=m["key"])))
    print(f"[toy] installed the shipped warm-started policy ({m['key']}; held-out greedy "
          f"{m['sft']['greedy_accuracy']:.3f}, sampled {m['sft']['sampled_accuracy']:.3f})", flush=True)


def build(out: Path, threads: int = 2) -> dict:
    """Warm-start the shipped recipe into `out` (FILES and shipped.json); returns the manifest. Run only
    in a process started with REPRODUCIBLE_ENV (torch reads it at import): `main` sees to that."""
    import torch

    from exgrpo_async import toy

    wrong = {k: os.environ.get(k) for k, v in REPRODUCIBLE_ENV.items() if os.environ.get(k) != v}
    if wrong:
        raise RuntimeError(f"the shipped policy is built only with {REPRODUCIBLE_ENV} (found {wrong})")
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        paths = {"model": root / "policy", "train": root / "train.jsonl", "test": root / "test.jsonl"}
        toy._build_toy_assets(root, paths, SEED, SFT_STEPS, train_questions=10, threads=threads)
        sft = json.loads((root / "sft.json").read_text())
        out.mkdir(parents=True, exist_ok=True)
        for name in FILES:
            shutil.copyfile(paths["model"] / name, out / name)
    for clock in ("sft_seconds", "accuracy_seconds"):  # the clock's figures, not the recipe's
        sft.pop(clock, None)
    m = {"key": toy.recipe_key(SEED, SFT_STEPS), "seed": SEED, "sft_steps": SFT_STEPS,
         "sha256": sha256(out / "model.safetensors"), "torch": torch.__version__, "build_env": REPRODUCIBLE_ENV,
         "sft": sft}
    (out / "shipped.json").write_text(json.dumps(m, indent=2) + "\n")
    return m


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="ops/toy-policy", description="Build the shipped toy policy, or rebuild "
                                 "it and compare bit for bit (about 6 minutes on 2 cores).")
    ap.add_argument("command", choices=("build", "check"), help="build: write exgrpo_async/toy_policy/; check: "
                    "rebuild into a temporary folder and compare with the shipped files")
    ap.add_argument("--threads", type=int, default=2, help="torch threads (the bits do not depend on it)")
    args = ap.parse_args(argv)
    if any(os.environ.get(k) != v for k, v in REPRODUCIBLE_ENV.items()):  # torch reads them at import
        env = dict(os.environ, **REPRODUCIBLE_ENV)
        return subprocess.call([sys.executable, "-m", "exgrpo_async.toy_shipped", *(argv or sys.argv[1:])], env=env)
    if args.command == "build":
        m = build(SHIPPED, args.threads)
        print(f"built {SHIPPED}: key {m['key']}, sha256 {m['sha256']}")
        return 0
    shipped = manifest()
    with tempfile.TemporaryDirectory() as tmp:
        m = build(Path(tmp), args.threads)
    same = shipped is not None and m["sha256"] == shipped["sha256"] and m["key"] == shipped["key"]
    print(json.dumps({"shipped": shipped and {k: shipped[k] for k in ("key", "sha256", "torch")},
                      "rebuilt": {k: m[k] for k in ("key", "sha256", "torch")}}, indent=2))
    print("PASS: the rebuilt policy is the shipped one, bit for bit" if same else
          "FAIL: the rebuilt policy differs from the shipped one (another recipe, torch or glibc?)")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
