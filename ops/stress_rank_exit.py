"""Stress the clean exit of a 2-rank learner (FSDP2 on gloo): how many of N exits abort.

Each round starts two processes that do what `exgrpo-async learner` does with learner.world_size=2,
minus the actors: join the group, shard the tiny policy, train two steps together, the lead says stop,
both close the group and exit, the follower right after its last broadcast. A rank that exits with
anything but 0 is counted, with the tail of its stderr. With `--plain-exit` the ranks end through the
interpreter's finalization instead of `learner.ranks.end_rank_process`, which shows the abort the
latter avoids (learner/ranks.py explains it).

    .venv/bin/python ops/stress_rank_exit.py --rounds 40 [--plain-exit]
"""

from __future__ import annotations

import argparse
import os
import random
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def rank_main(model: str, plain_exit: bool) -> int:
    import torch

    from exgrpo_async.config import RunConfig
    from learner.policy import Policy
    from learner.ranks import Ranks, end_rank_process
    from learner.update import Seq, StepSettings

    cfg = RunConfig()
    cfg.model.path, cfg.model.dtype, cfg.learner.mixed_precision = model, "float32", "none"
    cfg.learner.world_size, cfg.learner.device, cfg.learner.micro_batch_sequences = 2, "cpu", 3
    torch.set_num_threads(1)
    ranks = Ranks.from_env(2, "cpu", 60.0)
    try:
        torch.manual_seed(0)
        policy = Policy(cfg, ranks, torch.device("cpu"))
        if ranks.lead:
            rng = random.Random(0)
            for step in range(2):
                comps = [[rng.randrange(4, 90) for _ in range(rng.randrange(2, 12))] + [2] for _ in range(16)]
                seqs = [Seq([1, 5, 6], c, torch.full((len(c),), -2.0), rng.choice([-0.5, 0.5]), 0, i // 4,
                            False, False) for i, c in enumerate(comps)]
                policy.update(seqs, 4, StepSettings(clip=0.2), step)
            policy.stop()
        else:
            policy.follow()
    finally:
        ranks.close()
    if plain_exit:
        return 0
    end_rank_process(0)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=40)
    ap.add_argument("--plain-exit", action="store_true", help="end through interpreter finalization")
    ap.add_argument("--rank-of", help=argparse.SUPPRESS)  # internal: run one rank on this model
    args = ap.parse_args()
    if args.rank_of:
        return rank_main(args.rank_of, args.plain_exit)
    sys.path.insert(0, str(ROOT))
    from exgrpo_async.toy import build_model, build_tokenizer

    failures = []
    with tempfile.TemporaryDirectory() as tmp:
        model = Path(tmp) / "model"
        build_tokenizer(model)
        build_model(0).save_pretrained(str(model))
        for i in range(args.rounds):
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                port = s.getsockname()[1]
            cmd = [sys.executable, __file__, "--rank-of", str(model)] + (["--plain-exit"] if args.plain_exit else [])
            procs = [subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                                      env={**os.environ, "PYTHONPATH": str(ROOT), "MASTER_ADDR": "127.0.0.1",
                                           "MASTER_PORT": str(port), "WORLD_SIZE": "2", "RANK": str(r)})
                     for r in range(2)]
            for r, p in enumerate(procs):
                err = p.communicate(timeout=300)[1]
                if p.returncode != 0:
                    failures.append((i, r, p.returncode, err.strip().splitlines()[-3:]))
                    print(f"round {i}: rank {r} exited {p.returncode}: {' | '.join(failures[-1][3])}", flush=True)
    exit_kind = "interpreter finalization" if args.plain_exit else "end_rank_process"
    print(f"| exit | rounds | rank exits not 0 |\n|---|---|---|\n| {exit_kind} | {args.rounds} | {len(failures)} |")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
