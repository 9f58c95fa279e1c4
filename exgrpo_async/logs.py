"""One log format for every process, each line tagged with the process role and id.

Plain text by default (`HH:MM:SS LEVEL [role/id] logger: message`); JSON lines on request (one object
per line: ts, level, role, id, pid, logger, msg, and exc for a traceback), for log shippers. The format
comes from the `log_format` config key, the `--log-format` flag, or the EXGRPO_LOG_FORMAT environment
variable, which child processes inherit, so a launcher's actors and their vLLM workers log alike.
Python warnings become log records too; what C++ libraries print to stderr themselves (torch's
`[W...]` lines) bypasses Python and stays as it is.
"""

from __future__ import annotations

import datetime
import json
import logging
import os
import sys

ENV = "EXGRPO_LOG_FORMAT"
FORMATS = ("text", "json")


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


def setup_logging(role: str, ident: str = "", level: int = logging.INFO, fmt: str | None = None) -> None:
    """(Re)configure the root logger; call again with the id once it is known (an actor's comes from
    the learner). The chosen format is exported to $EXGRPO_LOG_FORMAT for child processes."""
    fmt = log_format(fmt)
    os.environ[ENV] = fmt
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
    logging.basicConfig(level=level, handlers=[handler], force=True)
    for noisy in ("vllm", "transformers", "urllib3", "httpx"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
