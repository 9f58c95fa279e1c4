"""`exgrpo-async` command line: train (local learner + actors), learner, actor, eval (benchmark scores),
report (a run's Markdown report with plots), config show / config diff (resolved configs as TOML).

Heavy imports (torch, vLLM) happen inside the commands, so `--help` and config errors are instant.
Config errors print a readable message and exit 2.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys


def _core_list(text: str) -> list[int]:
    """"2" or "2,3": CPU core numbers for --cpu-cores."""
    try:
        cores = [int(c) for c in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a comma-separated list of core numbers: {text!r}") from None
    if not cores or min(cores) < 0:
        raise argparse.ArgumentTypeError(f"bad core list {text!r}")
    return cores


def _seconds(text: str) -> float:
    """A positive number of seconds."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number of seconds: {text!r}") from None
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"seconds must be positive and finite: {text!r}")
    return value


ADVERTISE_HELP = ("this host's name or address as Prometheus reaches it, listed in the service-discovery file "
                  "when {key} is a wildcard (0.0.0.0); default: $EXGRPO_ADVERTISE_HOST, else the host's FQDN")


def _advertise(host: str | None) -> None:
    if host:
        from exgrpo_async.metrics import ADVERTISE_ENV

        os.environ[ADVERTISE_ENV] = host


def _common() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(add_help=False)
    p.add_argument("--log-format", choices=("text", "json"), help="log lines as text (default) or JSON lines; "
                   "child processes inherit it (also: EXGRPO_LOG_FORMAT)")
    p.add_argument("--log-level", choices=("debug", "info", "warning", "error"), help="least severe records "
                   "shown (default info; child processes inherit it; also: EXGRPO_LOG_LEVEL); debug also shows "
                   "vLLM's start-up warnings that are dropped otherwise")
    return p


def _config_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", help="TOML (or resolved JSON) config file; default: the embedded CPU demo")
    p.add_argument("overrides", nargs="*", help="dotted overrides, e.g. learner.lr=5e-5 rollout.samples_per_question=4")


def _load(args):
    from exgrpo_async.config_io import load_config

    try:
        return load_config(args.config, args.overrides)
    except ValueError as e:
        print(f"exgrpo-async: {e}", file=sys.stderr)
        sys.exit(2)


def _rehearsal(args):
    """The rehearsal's config, after printing the node's plan and every setting it replaces."""
    from exgrpo_async.launcher.rehearse import rehearsal

    try:
        cfg, gpu_plan, changes = rehearsal(args.config, args.overrides)
    except ValueError as e:
        print(f"exgrpo-async: {e}", file=sys.stderr)
        sys.exit(2)
    print("rehearsal on CPU of the node's plan:\n" + gpu_plan.table() + "\nreplaced for the rehearsal:\n" +
          "\n".join(f"  {line}" for line in changes), flush=True)
    return cfg


def _sigterm_exits() -> None:
    def handler(*_):
        raise SystemExit(143)

    signal.signal(signal.SIGTERM, handler)


def main(argv: list[str] | None = None) -> int:
    """Parse the command line, set up logging for the command's process, and run its handler."""
    args = parser().parse_args(argv)
    if args.cmd == "config":
        return _config(args)
    from exgrpo_async.logs import log_format, log_level

    try:
        log_format(args.log_format)
        log_level(args.log_level)
    except ValueError as e:  # a bad EXGRPO_LOG_FORMAT or EXGRPO_LOG_LEVEL
        print(f"exgrpo-async: {e}", file=sys.stderr)
        return 2
    return HANDLERS[args.cmd](args, {"fmt": args.log_format, "level_name": args.log_level})


def parser() -> argparse.ArgumentParser:
    """The command line: one sub-command per process role, and the run tools (eval, report, config)."""
    from exgrpo_async import __version__

    ap = argparse.ArgumentParser(prog="exgrpo-async", description=__doc__)
    ap.add_argument("--version", action="version", version=f"exgrpo-async {__version__}")
    sub = ap.add_subparsers(dest="cmd", required=True)
    common = _common()
    _train_args(sub.add_parser("train", parents=[common], help="train with a local learner and actors "
                               "(default: the CPU demo)"))
    _learner_args(sub.add_parser("learner", parents=[common], help="run the learner process"))
    _actor_args(sub.add_parser("actor", parents=[common], help="run one actor process that joins a learner"))
    _eval_args(sub.add_parser("eval", parents=[common], help="score a model on benchmark files: avg@N and pass@N per "
                              "data source", description="Sample N completions per question with vLLM, score them "
                              "with math-verify, print a table and write a JSON report. Prompt settings (data.*), "
                              "dtype (model.dtype), engine (actor.engine.*), verifier (actor.verifier.*) and CPU "
                              "threads per engine (actor.threads) come from --config and the dotted overrides."))
    p_report = sub.add_parser("report", parents=[common], help="write a run's report (Markdown + PNG plots)",
                              description="Read RUN_DIR/metrics.jsonl and summary.json and write RUN_DIR/report/"
                              "report.md with PNG plots (a train run writes it at its end too).")
    p_report.add_argument("run_dir", metavar="RUN_DIR", help="a run folder (runs/demo/run-...)")
    p_report.add_argument("--out", help="folder for report.md and the PNGs (default: RUN_DIR/report)")
    _config_commands(sub.add_parser("config", help="show a resolved config, or what differs between two runs'"))
    return ap


def _train_args(p: argparse.ArgumentParser) -> None:
    _config_args(p)
    p.add_argument("--resume", metavar="RUN_DIR", help="continue the run in RUN_DIR from its newest valid "
                   "checkpoint (its config.json is the default config; overrides such as learner.max_steps apply)")
    p.add_argument("--dry-run", action="store_true", help="print the resolved config and the GPU placement, "
                   "start nothing")
    p.add_argument("--rehearse", action="store_true", help="rehearse a GPU config on this machine's CPU: its "
                   "process topology, placement and code path at the toy shape, a few steps "
                   "(exgrpo_async/launcher/rehearse.py; prints every setting it replaces)")


def _learner_args(p: argparse.ArgumentParser) -> None:
    _config_args(p)
    p.add_argument("--run-dir", help="run folder (default: a new folder under output_dir)")
    p.add_argument("--resume", action="store_true", help="continue from the newest valid checkpoint in --run-dir")
    p.add_argument("--advertise-host", metavar="HOST", help=ADVERTISE_HELP.format(key="metrics.host"))


def _actor_args(p: argparse.ArgumentParser) -> None:
    where = p.add_mutually_exclusive_group(required=True)
    where.add_argument("--learner", help="the learner's address, tcp://HOST:PORT")
    where.add_argument("--learner-file", metavar="PATH", help="read the address from the learner's RUN_DIR/learner.json, "
                       "waiting for the learner to write it (up to 30 minutes); `train` starts its actors this way")
    p.add_argument("--cpu-cores", "--cpu-core", type=_core_list, metavar="LIST",
                   help="pin this actor to these CPU cores, e.g. 0 or 2,3 (CPU engines: one per TP worker)")
    p.add_argument("--keys", metavar="DIR", help="CurveZMQ key folder (ops/make-keys; needs server.key, "
                   "client.key, client.key_secret) when the learner has transport.curve_keys_dir")
    p.add_argument("--hello-retry-s", type=_seconds, metavar="SECONDS",
                   help="say hello again after this long without an answer (default 30; each retry is logged)")
    p.add_argument("--advertise-host", metavar="HOST", help=ADVERTISE_HELP.format(key="metrics.actor_host"))


def _eval_args(p: argparse.ArgumentParser) -> None:
    _config_args(p)
    p.add_argument("--model", help="Hugging Face model folder or hub id (default: the config's model.path)")
    p.add_argument("--data", action="append", metavar="FILE", help="question file (JSONL, JSON array, parquet); "
                   "repeat for several (default: the config's data.eval_file)")
    p.add_argument("--samples", type=int, help="N samples per question (default: rollout.eval_samples)")
    p.add_argument("--temperature", type=float, help="sampling temperature, 0 = greedy "
                   "(default: rollout.eval_temperature)")
    p.add_argument("--max-tokens", type=int, help="longest completion (default: rollout.max_new_tokens)")
    p.add_argument("--actors", type=int, default=1, help="engine processes, each on its own CPU cores "
                   "(actor.threads each) or GPUs, on a round-robin share of the questions (default: 1)")
    p.add_argument("--limit", type=int, help="only the first L questions of each data source")
    p.add_argument("--prompt-template", help="format string with {problem} (default: data.prompt_template)")
    p.add_argument("--chat-template", action="store_true", help="render prompts with the tokenizer's chat "
                   "template (data.use_chat_template=true)")
    p.add_argument("--seed", type=int, default=0, help="sampling seed (engine process i uses seed+i)")
    p.add_argument("--out", help="JSON report (default: eval-<timestamp>.json next to the model folder)")
    p.add_argument("--save-completions", action="store_true", help="also write every decoded completion")


def _train(args, logs: dict) -> int:
    """`train`: resolve the config (or its rehearsal, or the run's to resume), check it, launch the run."""
    from exgrpo_async.logs import setup_logging

    setup_logging("launch", **logs)
    if args.resume and not args.config:
        args.config = os.path.join(args.resume, "config.json")
        if not os.path.exists(args.config):
            print(f"exgrpo-async: --resume {args.resume}: no config.json there (not a run folder?)", file=sys.stderr)
            return 2
    from exgrpo_async.launcher.placement import PlacementError
    from exgrpo_async.launcher.train import dry_run, train
    from exgrpo_async.metrics import check_trackers

    if args.rehearse and args.resume:
        print("exgrpo-async: --rehearse with --resume: a rehearsed run resumes as one (its config.json says so)",
              file=sys.stderr)
        return 2
    cfg = _rehearsal(args) if args.rehearse else _load(args)
    try:
        check_trackers(cfg.metrics.trackers)  # a missing extra fails now, not after the warm start
    except ValueError as e:
        print(f"exgrpo-async: {e}", file=sys.stderr)
        return 2
    try:
        return dry_run(cfg) if args.dry_run else train(cfg, resume_dir=args.resume)
    except PlacementError as e:
        print(f"exgrpo-async: placement: {e}", file=sys.stderr)
        return 2


def _learner(args, logs: dict) -> int:
    """`learner`: the learner process (one rank of it under torchrun), after its pre-flight checks."""
    from exgrpo_async.logs import setup_logging

    setup_logging("learner", **logs)
    _sigterm_exits()
    _advertise(args.advertise_host)
    if args.resume and not args.run_dir:
        print("exgrpo-async: learner --resume needs --run-dir", file=sys.stderr)
        return 2
    from exgrpo_async.launcher import preflight
    from exgrpo_async.launcher.preflight import reward_function_loads

    cfg = _load(args)
    lead = os.environ.get("RANK", "0") == "0"  # under torchrun only rank 0 reads the data and writes the run
    if not reward_function_loads(cfg) or not preflight.report(preflight.check_learner(cfg, args.run_dir, lead)):
        return 2
    from exgrpo_async.startup import without_gc

    with without_gc():  # torch's import (exgrpo_async/startup.py); transformers' is learner/main.py's
        from learner.main import main as learner_main

    return learner_main(cfg, args.run_dir, args.resume)


def _actor(args, logs: dict) -> int:
    """`actor`: one actor process, joining the learner at --learner or --learner-file."""
    from exgrpo_async.logs import setup_logging

    setup_logging("actor", str(os.getpid()), **logs)
    _sigterm_exits()
    _advertise(args.advertise_host)
    from actors.main import main as actor_main

    actor_main(args.learner, args.cpu_cores, args.keys, args.hello_retry_s, args.learner_file)
    return 2  # actor_main ends the process itself; returning means it refused to start


def _eval_command(args, logs: dict) -> int:
    from exgrpo_async.launcher.preflight import reward_function_loads
    from exgrpo_async.logs import setup_logging

    setup_logging("eval", **logs)
    cfg = _load(args)
    return _eval(args, cfg) if reward_function_loads(cfg) else 2


def _report_command(args, logs: dict) -> int:
    from exgrpo_async.logs import setup_logging

    setup_logging("report", **logs)
    return _report(args)


HANDLERS = {"train": _train, "learner": _learner, "actor": _actor, "eval": _eval_command, "report": _report_command}


def _config_commands(p_config: argparse.ArgumentParser) -> None:
    sub = p_config.add_subparsers(dest="config_cmd", required=True)
    p_show = sub.add_parser("show", help="print the resolved config as TOML (defaults filled in)",
                            description="Print the config that --config and the overrides resolve to, as TOML "
                            "that `--config` reads back. Keys left unset (null) are listed in a comment: TOML "
                            "has no null.")
    _config_args(p_show)
    p_diff = sub.add_parser("diff", help="what differs between two runs' config.json",
                            description="Compare two resolved configs (run folders, or config files: TOML or "
                            "JSON) key by key; prints `key: A -> B` for each difference, exit 0 either way.")
    p_diff.add_argument("a", metavar="RUN_A", help="a run folder (its config.json) or a config file")
    p_diff.add_argument("b", metavar="RUN_B", help="the other one")


def _config(args) -> int:
    from exgrpo_async.config_io import config_diff, config_toml

    if args.config_cmd == "show":
        print(config_toml(_load(args)), end="")
        return 0
    a, b = (_load(argparse.Namespace(config=os.path.join(w, "config.json") if os.path.isdir(w) else w, overrides=[]))
            for w in (args.a, args.b))
    lines = config_diff(a, b)
    print("\n".join(lines) if lines else "the two configs are the same")
    return 0


def _report(args) -> int:
    from pathlib import Path

    from exgrpo_async.report.write import write_report

    try:
        path = write_report(Path(args.run_dir), Path(args.out) if args.out else None)
    except (OSError, ValueError) as e:
        print(f"exgrpo-async: report: {e}", file=sys.stderr)
        return 2
    print(f"report: {path}")
    return 0


def _eval(args, cfg) -> int:
    from pathlib import Path

    from exgrpo_async.launcher import preflight

    model = args.model or (cfg.model.path if cfg.model.path != "toy" else None)
    files = args.data or ([cfg.data.eval_file] if cfg.data.eval_file else [])
    samples = cfg.rollout.eval_samples if args.samples is None else args.samples
    temperature = cfg.rollout.eval_temperature if args.temperature is None else args.temperature
    max_tokens = cfg.rollout.max_new_tokens if args.max_tokens is None else args.max_tokens
    problems = [msg for bad, msg in [
        (model is None, "eval needs --model (or a --config whose model.path is a model folder)"),
        (not files, "eval needs --data FILE (or a --config with data.eval_file)"),
        (samples < 1, "--samples must be >= 1"), (temperature < 0, "--temperature must be >= 0"),
        (max_tokens < 1, "--max-tokens must be >= 1"), (args.actors < 1, "--actors must be >= 1"),
        (args.limit is not None and args.limit < 1, "--limit must be >= 1")] if bad]
    if problems:
        print(f"exgrpo-async: {problems[0]}", file=sys.stderr)
        return 2
    cfg = cfg.model_copy(deep=True)
    if args.prompt_template is not None:
        cfg.data.prompt_template = args.prompt_template
    cfg.data.use_chat_template = cfg.data.use_chat_template or args.chat_template
    cfg.model.path = model
    if not preflight.report(preflight.check_eval(cfg, files, args.out)):
        return 2

    from actors.main import run_eval

    return run_eval(cfg, model, files, samples, temperature, max_tokens, args.limit, args.actors, args.seed,
                    Path(args.out) if args.out else None, args.save_completions)


if __name__ == "__main__":
    sys.exit(main())
