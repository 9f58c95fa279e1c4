"""Write docs/config.md from the config schema's field docstrings (a test checks it is current).

Usage: .venv/bin/python ops/gen_config_doc.py [--check]
"""

from __future__ import annotations

import sys
from pathlib import Path

from pydantic import BaseModel

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from exgrpo_async.config import RunConfig  # noqa: E402

DOC = Path(__file__).resolve().parents[1] / "docs" / "config.md"
HEADER = """# Config reference

Generated from `exgrpo_async/config.py` by `ops/gen_config_doc.py`; do not edit by hand.
Set values in a TOML file (`--config FILE`) or as dotted overrides (`learner.lr=5e-5`). Unknown keys and
bad values are rejected with a message naming the key. The resolved config of every run is written to
`RUN_DIR/config.json`, which `--config` also accepts.
"""


def _rows(model: type[BaseModel], prefix: str, out: list[str]) -> None:
    nested = []
    for name, field in model.model_fields.items():
        ann = field.annotation
        if isinstance(ann, type) and issubclass(ann, BaseModel):
            nested.append((name, ann, field))
            continue
        default = field.default
        doc = (field.description or "").replace("\n", " ").replace("|", "\\|")
        out.append(f"| `{prefix}{name}` | `{default!r}` | {doc} |")
    for name, ann, field in nested:
        out.append("")
        out.append(f"## `{prefix}{name}`")
        out.append("")
        out.append((field.description or "").replace("\n", " "))
        out.append("")
        out.append("| key | default | meaning |")
        out.append("|---|---|---|")
        _rows(ann, f"{prefix}{name}.", out)


def render() -> str:
    out = [HEADER, "## top level", "", "| key | default | meaning |", "|---|---|---|"]
    _rows(RunConfig, "", out)
    return "\n".join(out) + "\n"


if __name__ == "__main__":
    text = render()
    if "--check" in sys.argv:
        sys.exit(0 if DOC.exists() and DOC.read_text() == text else 1)
    DOC.write_text(text)
    print(f"wrote {DOC}")
