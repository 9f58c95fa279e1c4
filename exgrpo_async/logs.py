"""One log format for every process, each line tagged with the process role and id."""

from __future__ import annotations

import logging
import sys


def setup_logging(role: str, ident: str = "", level: int = logging.INFO) -> None:
    tag = f"{role}{'/' + ident if ident else ''}"
    fmt = f"%(asctime)s %(levelname)s [{tag}] %(name)s: %(message)s"
    logging.basicConfig(level=level, format=fmt, datefmt="%H:%M:%S", stream=sys.stderr, force=True)
    for noisy in ("vllm", "transformers", "urllib3", "httpx"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
