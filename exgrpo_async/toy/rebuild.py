"""`ops/toy-policy build|check`: build the shipped toy policy (exgrpo_async/toy/shipped.py), or rebuild it
in a temporary folder and compare it with the shipped files bit for bit. The build runs in a process
started with toy_shipped.REPRODUCIBLE_ENV (torch reads it at import): `main` restarts itself with it."""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from exgrpo_async.toy import task as toy
from exgrpo_async.toy.shipped import FILES, REPRODUCIBLE_ENV, SEED, SFT_STEPS, SHIPPED, manifest, sha256


def build(out: Path, threads: int = 2) -> dict:
    """Warm-start the shipped recipe into `out` (FILES and shipped.json); returns the manifest. Run only
    in a process started with REPRODUCIBLE_ENV (torch reads it at import): `main` sees to that."""
    import torch

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
    ap.add_argument("command", choices=("build", "check"), help="build: write exgrpo_async/toy/policy/; check: "
                    "rebuild into a temporary folder and compare with the shipped files")
    ap.add_argument("--threads", type=int, default=2, help="torch threads (the bits do not depend on it)")
    args = ap.parse_args(argv)
    if any(os.environ.get(k) != v for k, v in REPRODUCIBLE_ENV.items()):  # torch reads them at import
        env = dict(os.environ, **REPRODUCIBLE_ENV)
        return subprocess.call([sys.executable, "-m", "exgrpo_async.toy.rebuild", *(argv or sys.argv[1:])], env=env)
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
