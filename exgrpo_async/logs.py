"""One log format for every process, each line tagged with the process role and id.

Plain text by default (`HH:MM:SS LEVEL [role/id] logger: message`); JSON lines on request (one object
per line: ts, level, role, id, pid, logger, msg, and exc for a traceback), for log shippers. The format
comes from the `log_format` config key, the `--log-format` flag, or the EXGRPO_LOG_FORMAT environment
variable, which child processes inherit, so a launcher's actors and their vLLM workers log alike.
Python warnings become log records too; what C++ libraries print to stderr themselves (torch's
`[W...]` lines) bypasses Python and stays as it is.

The level comes from `--log-level` or EXGRPO_LOG_LEVEL (inherited the same way; default info). Below
debug, vLLM's start-up warnings that tell a user of this project nothing (`VLLM_NOISE`: each actor
prints them, some on every weight reload) are dropped; `--log-level debug` shows them and vLLM's info.
"""

from __future__ import annotations

import datetime
import json
import logging
import os
import sys
from typing import NoReturn

ENV = "EXGRPO_LOG_FORMAT"
FORMATS = ("text", "json")
LEVEL_ENV = "EXGRPO_LOG_LEVEL"
LEVELS = ("debug", "info", "warning", "error")
# Substrings of vLLM's warnings (and Python warnings raised in vLLM's code) that are expected on this
# project's set-up: the CPU backend's thread binding, the preload and Triton hints, the eager mode we
# choose, the seed we set, deprecations inside vLLM, a float32 checkpoint read into the bf16 engine that
# `model.dtype` asked for (one line per weight).
VLLM_NOISE = ("`torch.set_num_threads` after the thread binding", "is not found in LD_PRELOAD", "Triton",
              "triton-cpu", "Reset SSM cache type", "Model Runner V2", "Inductor compilation was disabled",
              "Enforce eager set", "The global random seed is set to", "torch.distributed.reduce_op",
              "with dtype torch.float32 into parameter with dtype torch.bfloat16")


class DropVllmNoise(logging.Filter):
    """Drops the records of `VLLM_NOISE` (from vLLM's loggers, or Python warnings about vLLM's files)."""

    def filter(self, record: logging.LogRecord) -> bool:
        if not (record.name.startswith("vllm") or (record.name == "py.warnings" and "/vllm/" in str(record.msg))):
            return True
        message = record.getMessage()
        return not any(s in message for s in VLLM_NOISE)


class JsonLinesFormatter(logging.Formatter):
    def __init__(self, role: str, ident: str):
        super().__init__()
        self.role, self.ident = role, ident

    def format(self, record: logging.LogRecord) -> str:
        out = {
            "ts": datetime.datetime.fromtimestamp(record.created, datetime.timezone.utc).isoformat(timespec="milliseconds"),
            "level": record.levelname, "role": self.role, "id": self.ident, "pid": record.process,
            "logger": record.name, "msg": record.getMessage(),
        }
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        return json.dumps(out, ensure_ascii=False)


def log_format(requested: str | None = None) -> str:
    """The format to use: `requested`, else $EXGRPO_LOG_FORMAT, else text; anything else is an error."""
    fmt = requested or os.environ.get(ENV) or "text"
    if fmt not in FORMATS:
        raise ValueError(f"log format {fmt!r}: use one of {', '.join(FORMATS)} ({ENV} or --log-format)")
    return fmt


def log_level(requested: str | None = None) -> str:
    """The level to use: `requested`, else $EXGRPO_LOG_LEVEL, else info; anything else is an error."""
    level = (requested or os.environ.get(LEVEL_ENV) or "info").lower()
    if level not in LEVELS:
        raise ValueError(f"log level {level!r}: use one of {', '.join(LEVELS)} ({LEVEL_ENV} or --log-level)")
    return level


def setup_logging(role: str, ident: str = "", level: int | None = None, fmt: str | None = None,
                  level_name: str | None = None) -> None:
    """(Re)configure the root logger; call again with the id once it is known (an actor's comes from
    the learner). The chosen format and level are exported ($EXGRPO_LOG_FORMAT, $EXGRPO_LOG_LEVEL) for
    child processes; `level` (a logging constant) overrides the level of this process only."""
    fmt = log_format(fmt)
    os.environ[ENV] = fmt
    name = os.environ[LEVEL_ENV] = log_level(level_name)
    debug = name == "debug"
    # vLLM otherwise installs its own handler and format on its loggers; without it they reach ours
    os.environ.setdefault("VLLM_CONFIGURE_LOGGING", "0")
    if fmt == "json":  # progress bars are not JSON lines (Hugging Face's; vLLM's are off in engine_kwargs)
        os.environ["HF_HUB_DISABLE_PROGRESS_BARS"] = "1"
    logging.captureWarnings(True)  # Python warnings (deprecations in libraries) as log records
    handler = logging.StreamHandler(sys.stderr)
    if fmt == "json":
        handler.setFormatter(JsonLinesFormatter(role, ident))
    else:
        tag = f"{role}{'/' + ident if ident else ''}"
        handler.setFormatter(logging.Formatter(f"%(asctime)s %(levelname)s [{tag}] %(name)s: %(message)s",
                                               datefmt="%H:%M:%S"))
    if not debug:
        handler.addFilter(DropVllmNoise())
    logging.basicConfig(level=level if level is not None else getattr(logging, name.upper()), handlers=[handler],
                        force=True)
    for noisy in ("vllm", "transformers", "urllib3", "httpx"):
        logging.getLogger(noisy).setLevel(logging.DEBUG if debug else logging.WARNING)


def end_process(rc: int) -> NoReturn:
    """End this process now, without the interpreter's finalization, once everything it owns is closed.

    Tearing down torch and vLLM at exit takes seconds (3-5 s per learner or actor process on this
    2-core machine, every run) and can abort a process whose gloo worker threads outlive their group
    (learner/ranks.py `end_rank_process`). Logs and the standard streams are flushed first."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(rc)
