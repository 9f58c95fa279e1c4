"""A config read and written: TOML (or a resolved JSON config, or the embedded CPU-demo default) plus dotted
command-line overrides such as `learner.lr=5e-5`, validated against the schema in config.py with every bad
field named; the resolved config back to TOML; two configs' differences."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import tomllib
from pydantic import ValidationError

from exgrpo_async.config import RunConfig


def _set_dotted(tree: dict, dotted: str, value: Any) -> None:
    keys = dotted.split(".")
    node = tree
    for k in keys[:-1]:
        node = node.setdefault(k, {})
        if not isinstance(node, dict):
            raise ValueError(f"override {dotted!r}: {k!r} is not a section")
    node[keys[-1]] = value


def parse_override_value(text: str) -> Any:
    """Override values are TOML/JSON literals when they parse as one, plain strings otherwise."""
    try:
        return tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        return text


def load_config(path: str | Path | None = None, overrides: list[str] | None = None) -> RunConfig:
    """Load a TOML file (a resolved .json config too; the embedded default when None) and apply `key.sub=value` overrides."""
    tree: dict = {}
    if path is not None:
        p = Path(path)
        if not p.exists():
            raise ValueError(f"config file {p} does not exist")
        try:
            tree = json.loads(p.read_text()) if p.suffix == ".json" else tomllib.loads(p.read_text())
        except (tomllib.TOMLDecodeError, json.JSONDecodeError) as e:
            raise ValueError(f"config file {p} is not valid {p.suffix.lstrip('.').upper() or 'TOML'}: {e}") from None
    for item in overrides or []:
        if "=" not in item:
            raise ValueError(f"override {item!r} must look like section.key=value")
        key, text = item.split("=", 1)
        _set_dotted(tree, key.strip(), parse_override_value(text.strip()))
    return _validate(tree, f" ({path})" if path else "")


def _validate(tree: dict, where: str = "") -> RunConfig:
    """The config of `tree`, or ValueError listing every bad field (`where`: the file, for the message)."""
    try:
        return RunConfig.model_validate(tree)
    except ValidationError as e:
        lines = [f"  {'.'.join(str(x) for x in err['loc'])}: {err['msg']}" for err in e.errors()]
        raise ValueError(f"invalid config{where}:\n" + "\n".join(lines)) from None


def with_values(cfg: RunConfig, values: dict[str, Any]) -> RunConfig:
    """`cfg` with dotted keys set to `values` (Python values, not override text), validated again."""
    tree = json.loads(cfg.model_dump_json())
    for key, value in values.items():
        _set_dotted(tree, key, value)
    return _validate(tree)


def config_from_json(text: str) -> RunConfig:
    """The inverse of `config.model_dump_json()`; used by actors receiving the learner's config."""
    return RunConfig.model_validate(json.loads(text))


def _flat(tree: Any, prefix: str = "") -> dict[str, Any]:
    if not isinstance(tree, dict):
        return {prefix: tree}
    out: dict[str, Any] = {}
    for key, value in tree.items():
        out.update(_flat(value, f"{prefix}{key}" if not prefix else f"{prefix}.{key}"))
    return out


def config_toml(cfg: RunConfig) -> str:
    """The config as TOML that `load_config` reads back to an equal config. TOML has no null: unset
    keys are left out, which reads back as unset, and named in a leading comment."""
    import tomli_w

    tree = cfg.model_dump(mode="json")
    unset = [k for k, v in _flat(tree).items() if v is None]

    def drop_none(node: Any) -> Any:
        return {k: drop_none(v) for k, v in node.items() if v is not None} if isinstance(node, dict) else node

    head = "# exgrpo-async resolved config\n"
    if unset:
        head += "# unset (null): " + ", ".join(unset) + "\n"
    return head + tomli_w.dumps(drop_none(tree))


def config_diff(a: RunConfig, b: RunConfig) -> list[str]:
    """`key: A -> B` for every key whose value differs between two configs, in key order."""
    fa, fb = _flat(a.model_dump(mode="json")), _flat(b.model_dump(mode="json"))
    return [f"{k}: {json.dumps(fa.get(k))} -> {json.dumps(fb.get(k))}" for k in sorted(fa.keys() | fb.keys())
            if fa.get(k) != fb.get(k)]
