"""`exgrpo-async` command line: train (local learner + actors), learner, actor.

Heavy imports (torch, vLLM) happen inside the commands, so `--help` and config errors are instant.
Config errors print a readable message and exit 2.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys


def _config_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", help="TOML (or resolved JSON) config file; default: the embedded CPU demo")
    p.add_argument("overrides", nargs="*", help="dotted overrides, e.g. learner.lr=5e-5 rollout.samples_per_question=4")


def _load(args):
    from exgrpo_async.config import load_config

    try:
        return load_config(args.config, args.overrides)
    except ValueError as e:
        print(f"exgrpo-async: {e}", file=sys.stderr)
        sys.exit(2)


def _sigterm_exits() -> None:
    def handler(*_):
        raise SystemExit(143)

    signal.signal(signal.SIGTERM, handler)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="exgrpo-async", description=__doc__)
    sub = ap.add_subparsers(dest="cmd", required=True)
    p_train = sub.add_parser("train", help="train with a local learner and actors (default: the CPU demo)")
    _config_args(p_train)
    p_train.add_argument("--resume", metavar="RUN_DIR", help="continue the run in RUN_DIR from its newest valid "
                         "checkpoint (its config.json is the default config; overrides such as learner.max_steps apply)")
    p_learner = sub.add_parser("learner", help="run the learner process")
    _config_args(p_learner)
    p_learner.add_argument("--run-dir", help="run folder (default: a new folder under output_dir)")
    p_learner.add_argument("--resume", action="store_true", help="continue from the newest valid checkpoint in --run-dir")
    p_actor = sub.add_parser("actor", help="run one actor process that joins a learner")
    p_actor.add_argument("--learner", required=True, help="the learner's address, tcp://HOST:PORT")
    p_actor.add_argument("--cpu-core", type=int, help="pin this actor to one CPU core (CPU engines)")
    p_actor.add_argument("--keys", metavar="DIR", help="CurveZMQ key folder (ops/make-keys; needs server.key, "
                         "client.key, client.key_secret) when the learner has transport.curve_keys_dir")
    args = ap.parse_args(argv)

    from exgrpo_async.logs import setup_logging

    if args.cmd == "train":
        setup_logging("launch")
        from exgrpo_async.launch import train

        if args.resume and not args.config:
            args.config = os.path.join(args.resume, "config.json")
            if not os.path.exists(args.config):
                print(f"exgrpo-async: --resume {args.resume}: no config.json there (not a run folder?)", file=sys.stderr)
                return 2
        return train(_load(args), resume_dir=args.resume)
    if args.cmd == "learner":
        setup_logging("learner")
        _sigterm_exits()
        from learner.main import main as learner_main

        if args.resume and not args.run_dir:
            print("exgrpo-async: learner --resume needs --run-dir", file=sys.stderr)
            return 2
        return learner_main(_load(args), args.run_dir, args.resume)
    if args.cmd == "actor":
        setup_logging("actor", str(os.getpid()))
        _sigterm_exits()
        from actors.main import main as actor_main

        return actor_main(args.learner, args.cpu_core, args.keys)
    return 2


if __name__ == "__main__":
    sys.exit(main())
