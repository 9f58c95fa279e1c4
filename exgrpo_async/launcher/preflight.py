"""Job: find a user's first mistakes before `exgrpo-async train` spawns a process, builds the toy policy or
probes the precision, so each fails in a second as one line, not after a minute as a child's traceback.

Checked: the data files (each exists, is a file of a known type, and its first rows parse as
exgrpo_async/data.py parses them, `data.skip_bad_rows` respected); the model folder (config.json,
weights, a tokenizer, and a chat template where the config renders with the tokenizer's own), or a
hub id (org/name) where no such folder exists; the output folder (creatable and writable); every fixed
port (free to bind on its host). Each problem is one line naming the setting, its value and what is
wrong; `train` prints each as "exgrpo-async: ..." and exits with code 2. `learner` checks what it reads
(model; on its lead rank the data and the run folder). No torch, vLLM or transformers here.
"""

from __future__ import annotations

import errno
import json
import os
import re
import socket
import sys
import tempfile
from pathlib import Path

from exgrpo_async.config import RunConfig
from exgrpo_async.custom_reward import RewardFunctionError, load_reward_function
from exgrpo_async.data import DataError, check_file

FIRST_ROWS = 20  # rows of each data file parsed up front
_HUB_PART = re.compile(r"[A-Za-z0-9._-]+")
WEIGHT_SUFFIXES = (".safetensors", ".bin")
WEIGHT_INDEXES = ("model.safetensors.index.json", "pytorch_model.bin.index.json")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "vocab.txt",
                   "spiece.model", "sentencepiece.bpe.model")
CHAT_TEMPLATE_FILES = ("chat_template.jinja", "chat_template.json")


def is_hub_id(text: str) -> bool:
    """Whether `text` has the form of a Hugging Face hub id: org/name, one slash, no leading / . or ~."""
    parts = text.split("/")
    return (len(parts) == 2 and not text.startswith((".", "~"))
            and all(_HUB_PART.fullmatch(p) and p not in (".", "..") for p in parts))


def check_data(cfg: RunConfig, rows: int = FIRST_ROWS) -> list[str]:
    """Problems of `data.train_files` and `data.eval_file`: each must be readable and its first `rows`
    rows must parse (a bad one is fine with data.skip_bad_rows=true, as long as one is good)."""
    files = [("data.train_files", f) for f in cfg.data.train_files]
    if cfg.data.eval_file:
        files.append(("data.eval_file", cfg.data.eval_file))
    return check_files(files, cfg.data.skip_bad_rows, rows)


def check_files(files: list[tuple[str, str]], skip_bad_rows: bool, rows: int = FIRST_ROWS) -> list[str]:
    """Problems of each (setting, path): readable, its first `rows` rows parsing (`check_file`)."""
    problems = []
    for setting, path in files:
        try:
            check_file(path, rows, skip_bad_rows=skip_bad_rows)
        except DataError as e:
            problems.append(f"{setting}: {e}")
    return problems


def _has_chat_template(names: set[str], tokenizer_config: dict) -> bool:
    return bool(tokenizer_config.get("chat_template")) or any(n in names for n in CHAT_TEMPLATE_FILES)


def check_model(cfg: RunConfig, setting: str = "model.path") -> list[str]:
    """Problems of `model.path` (nothing to check for "toy" or a hub id): a folder with config.json,
    weights and a tokenizer, which must have a chat template if prompts are rendered with its own.
    `setting` names where the path came from (`eval`'s --model)."""
    path = cfg.model.path
    if path == "toy":
        return []
    where, folder = (f"{setting} {path}" if setting.startswith("--") else f"{setting}={path}"), Path(path)
    if not folder.exists():
        return [] if is_hub_id(path) else [f"{where}: no such folder (and not a hub id like org/name)"]
    if not folder.is_dir():
        return [f"{where}: not a folder (a Hugging Face model folder, or a hub id like org/name)"]
    try:
        names = {p.name for p in folder.iterdir()}
    except OSError as e:
        return [f"{where}: cannot read the folder ({e.strerror})"]
    problems = []
    if "config.json" not in names:
        problems.append(f"{where}: no config.json in the folder")
    if not any(n.endswith(WEIGHT_SUFFIXES) or n in WEIGHT_INDEXES for n in names):
        problems.append(f"{where}: no weights in the folder (*.safetensors, *.bin, or their index .json)")
    if not any(n in names for n in TOKENIZER_FILES):
        problems.append(f"{where}: no tokenizer in the folder (tokenizer.json, tokenizer_config.json, "
                        "tokenizer.model or vocab files)")
        return problems
    tokenizer_config: dict = {}
    if "tokenizer_config.json" in names:
        try:
            loaded = json.loads((folder / "tokenizer_config.json").read_text(encoding="utf-8"))
            tokenizer_config = loaded if isinstance(loaded, dict) else {}
        except (OSError, ValueError) as e:
            return problems + [f"{where}: tokenizer_config.json cannot be read as JSON ({e})"]
    if (cfg.data.use_chat_template and cfg.data.chat_template is None
            and not _has_chat_template(names, tokenizer_config)):
        problems.append(f"{where}: data.use_chat_template=true but the tokenizer has no chat template (no "
                        "chat_template in tokenizer_config.json, no chat_template.jinja or .json); set "
                        "data.chat_template (\"think\" or a Jinja template)")
    return problems


def check_output(path: str, setting: str = "output_dir", shown: str | None = None) -> list[str]:
    """Problems of the folder runs are written to (`setting` names it: output_dir, --resume, --run-dir;
    `shown` is the value quoted, `path` by default): it must be a writable folder, or creatable (its nearest
    existing parent a writable folder), and a file must be writable in it (`write_problem`: tried, not inferred)."""
    value = shown or path
    where = f"{setting} {value}" if setting.startswith("--") else f"{setting}={value}"
    target = Path(path)
    if target.exists():
        if not target.is_dir():
            return [f"{where}: exists and is not a folder"]
        if not os.access(target, os.W_OK | os.X_OK):
            return [f"{where}: the folder is not writable"]
    else:
        parent = next(p for p in target.absolute().parents if p.exists())  # "/" exists
        if not parent.is_dir():
            return [f"{where}: cannot be created: {parent} is a file, not a folder"]
        if not os.access(parent, os.W_OK | os.X_OK):
            return [f"{where}: cannot be created: {parent} is not writable"]
    return [] if (why := write_problem(target)) is None else [f"{where}: cannot write there ({why})"]


def write_problem(folder: Path) -> str | None:
    """Why a file cannot be made in `folder`, by making one (and the folder, if missing), or None; what the
    probe made is removed again. os.access answers from permissions alone, and yes to root anywhere: a
    pseudo-filesystem such as /proc, or a share that maps root to nobody, shows only when tried."""
    made = [p for p in (folder.absolute(), *folder.absolute().parents) if not p.exists()]  # deepest first
    try:
        folder.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=folder):
            pass
    except OSError as e:
        return e.strerror or type(e).__name__
    finally:
        for p in made:
            try:
                p.rmdir()
            except OSError:
                break
    return None


def fixed_ports(cfg: RunConfig) -> list[tuple[str, str, int]]:
    """(setting, host, port) of every fixed (non-zero) port a local `train` binds; 0 and None bind none.
    The weight-sync store listens on transport.host; local actors bind metrics.actor_port."""
    t, m = cfg.transport, cfg.metrics
    ports = [("transport.port", t.host, t.port), ("weight_sync.port", t.host, cfg.weight_sync.port),
             ("metrics.port", m.host, m.port)]
    if cfg.actor.num_actors != 0:
        ports.append(("metrics.actor_port", m.actor_host, m.actor_port))
    return [(setting, host, port) for setting, host, port in ports if port]


def port_problem(host: str, port: int) -> str | None:
    """Why `port` cannot be bound on `host` now (as a server binds it, SO_REUSEADDR), or None."""
    try:
        family, kind, proto, _, addr = socket.getaddrinfo(host.strip("[]") or None, port, type=socket.SOCK_STREAM,
                                                          flags=socket.AI_PASSIVE)[0]
    except socket.gaierror as e:
        return f"cannot resolve the host {host} ({e.strerror})"
    with socket.socket(family, kind, proto) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(addr)
        except OSError as e:
            if e.errno == errno.EADDRINUSE:
                return f"already in use on {host} (pick another port, or 0 for a free one)"
            return f"cannot bind {host}:{port} ({e.strerror})"
    return None


def check_ports(cfg: RunConfig) -> list[str]:
    """Problems of the fixed ports: each must be free on its host, and no two settings may share one."""
    problems, taken = [], {}  # port -> (setting, host) of the first setting naming it
    wildcard = ("0.0.0.0", "::", "[::]", "")
    for setting, host, port in fixed_ports(cfg):
        other = taken.setdefault(port, (setting, host))
        if other[0] != setting and (other[1] == host or host in wildcard or other[1] in wildcard):
            problems.append(f"{setting}={port}: {other[0]} uses the same port on {other[1]}")
        elif (why := port_problem(host, port)) is not None:
            problems.append(f"{setting}={port}: {why}")
    if cfg.metrics.actor_port and (cfg.actor.num_actors or 0) > 1:
        problems.append(f"metrics.actor_port={cfg.metrics.actor_port}: fixed, but train starts "
                        f"{cfg.actor.num_actors} actors on this host, each binding it (use 0 for free ports)")
    return problems


def check(cfg: RunConfig, resume_dir: str | None = None) -> list[str]:
    """Every problem `train` can find before it starts anything, one line each (empty: none found)."""
    out = check_output(resume_dir, "--resume") if resume_dir else check_output(cfg.output_dir)
    return check_data(cfg) + check_model(cfg) + out + check_ports(cfg)


def check_eval(cfg: RunConfig, files: list[str], out: str | None) -> list[str]:
    """What `exgrpo-async eval` reads and writes, before it starts an engine: the model (`cfg.model.path`,
    given as --model), each --data file, and the folder of the --out report (a folder in place of the
    file is refused: the report would be lost after the whole evaluation)."""
    problems = check_model(cfg, "--model") + check_files([("--data", f) for f in files], cfg.data.skip_bad_rows)
    if out is not None:
        problems += ([f"--out {out}: a folder; give the report's file name"] if Path(out).is_dir()
                     else check_output(str(Path(out).parent), "--out", shown=out))
    return problems


def check_learner(cfg: RunConfig, run_dir: str | None = None, lead: bool = True) -> list[str]:
    """What `exgrpo-async learner` reads and writes: the model (every rank loads it); on the lead rank the
    data files and the run folder too. Ports are `train`'s check only."""
    if not lead:
        return check_model(cfg)
    out = check_output(run_dir, "--run-dir") if run_dir else check_output(cfg.output_dir)
    return check_data(cfg) + check_model(cfg) + out


def report(problems: list[str]) -> bool:
    """Print each problem as "exgrpo-async: ..." on stderr; True when there is none."""
    for line in problems:
        print(f"exgrpo-async: {line}", file=sys.stderr)
    return not problems


def reward_function_loads(cfg: RunConfig) -> bool:
    """Whether `actor.verifier.function` (if set) imports here; if not, says why on stderr. Cheap (a
    Python import), and checked before anything starts: every actor would fail with the same error."""
    if cfg.actor.verifier.function is None:
        return True
    try:
        load_reward_function(cfg.actor.verifier.function)
        return True
    except RewardFunctionError as e:
        print(f"exgrpo-async: {e}", file=sys.stderr)
        return False
