"""Save and restore the learner's complete training state, atomically, so a crashed run can resume.

A checkpoint is a folder `ckpt_root/step-000010/` holding
- `model/`: the policy in Hugging Face format (usable on its own, e.g. for evaluation),
- `optimizer.pt`: the optimizer state keyed by parameter name (torch.distributed.checkpoint's full
  state dict), so a checkpoint of any number of learner ranks resumes into any other, `rng.pt`: torch CPU/CUDA and numpy RNG states (both read back
  with `torch.load(weights_only=True)`, so loading runs no pickled code),
- `state.json` + `arrays.npz`: the loop's own state and the experience buffer; JSON for the plain
  values, numpy arrays (token ids, log-probs, ...) pulled out into the npz (loaded with
  allow_pickle=False),
- `manifest.json`, written last: the step and every other file with its size and sha256.
Everything is written into `ckpt_root/.tmp-step-000010/`, fsynced, then renamed into place, so a crash
leaves either a complete checkpoint or a dot folder that is never read. A checkpoint without a manifest,
or whose files do not match it, is partial or corrupt: `latest_valid` skips it with a warning.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import random
import re
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from learner.maths.buffer import ExperienceBuffer
from learner.model import save_policy

log = logging.getLogger("exgrpo_async.learner.checkpoint")

_NAME = re.compile(r"^step-(\d+)$")
_MARKERS = ("__array__", "__tuple__", "__items__")
FORMAT = 2  # 2: optimizer state keyed by parameter name


class CheckpointError(RuntimeError):
    """A checkpoint folder that is partial, corrupt, or does not fit the model it is loaded into."""


def save_checkpoint(ckpt_root: Path, step: int, model: torch.nn.Module, tokenizer: Any,
                    optimizer: torch.optim.Optimizer, state: dict, buffer: ExperienceBuffer | None = None,
                    keep_last: int = 2, full_state: tuple[dict, dict] | None = None) -> Path:
    """Write the checkpoint of `step` and return its folder; then delete all but the newest `keep_last`,
    and any of a later step (a history abandoned by resuming from an earlier checkpoint).

    `state` is the loop's state: nested dicts (any scalar keys), lists, tuples, str/int/float/bool/None
    and numeric numpy arrays; it comes back from `load_checkpoint` with the same types. Global RNG
    states (python `random`, numpy, torch CPU and CUDA) are captured here; a `random.Random` of the
    loop goes in `state` as `rng.getstate()`. Call only between steps, where the state is consistent.
    `full_state` (weights, optimizer state) by parameter name comes from a sharded learner
    (`Policy.full_state`); without it they are read from `model` and `optimizer` here.
    """
    weights, optim = full_state if full_state is not None else local_full_state(model, optimizer)
    ckpt_root = Path(ckpt_root)
    ckpt_root.mkdir(parents=True, exist_ok=True)
    final, tmp = ckpt_root / f"step-{step:06d}", ckpt_root / f".tmp-step-{step:06d}"
    shutil.rmtree(tmp, ignore_errors=True)  # debris of a save that crashed
    tmp.mkdir()
    save_policy(model, tokenizer, tmp / "model", weights=weights)
    torch.save(optim, tmp / "optimizer.pt")
    torch.save({"torch": torch.get_rng_state(),
                "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else []}, tmp / "rng.pt")
    arrays: dict[str, np.ndarray] = {}
    doc = {"format": FORMAT, "step": step, "state": _encode(state, arrays),
           "buffer": _encode(buffer.state_dict(), arrays) if buffer is not None else None,
           "python_random": _encode(random.getstate(), arrays), "numpy_random": _encode(np.random.get_state(), arrays)}
    with open(tmp / "arrays.npz", "wb") as f:
        np.savez(f, **arrays)
    (tmp / "state.json").write_text(json.dumps(doc))

    files = {}
    for p in sorted(x for x in tmp.rglob("*") if x.is_file()):
        files[p.relative_to(tmp).as_posix()] = {"size": p.stat().st_size, "sha256": _sha256(p)}
        _fsync(p)  # save_pretrained and np.savez do not sync
    _write_synced(tmp / "manifest.json", json.dumps({"format": FORMAT, "step": step, "files": files}, indent=1))
    for d in sorted({p.parent for p in tmp.rglob("*")} | {tmp}, key=lambda d: -len(d.parts)):
        _fsync(d)
    if final.exists():  # the same step saved again (periodic and shutdown save coincide)
        trash = ckpt_root / f".trash-step-{step:06d}"
        shutil.rmtree(trash, ignore_errors=True)
        os.rename(final, trash)
    os.rename(tmp, final)
    _fsync(ckpt_root)
    _prune(ckpt_root, step, keep_last)
    log.info("checkpoint of step %d written to %s", step, final)
    return final


def load_checkpoint(path: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None,
                    buffer: ExperienceBuffer | None = None, verify: bool = True) -> dict:
    """Restore model weights, optimizer, global RNGs and (if given) `buffer` in place from `path`;
    return the saved `state` plus "step". `verify=False` skips re-hashing a folder `latest_valid`
    has just checked."""
    path = Path(path)
    if verify and (why := verify_checkpoint(path)) is not None:
        raise CheckpointError(f"{path}: {why}")
    doc = json.loads((path / "state.json").read_text())
    if doc.get("format") != FORMAT:
        raise CheckpointError(f"{path} has checkpoint format {doc.get('format')}; this version reads {FORMAT} "
                              "(the optimizer state is keyed by parameter name since format 2)")
    with np.load(path / "arrays.npz", allow_pickle=False) as z:
        arrays = {k: z[k] for k in z.files}
    if model is not None:
        weights, optim = read_training_state(path, model, optimizer is not None)
        opts = StateDictOptions(full_state_dict=True, strict=False)
        set_model_state_dict(model, weights, options=opts)
        if optimizer is not None:
            set_optimizer_state_dict(model, optimizer, optim, options=opts)
    rng = torch.load(path / "rng.pt", map_location="cpu", weights_only=True)
    torch.set_rng_state(rng["torch"])
    if rng["cuda"] and torch.cuda.is_available() and len(rng["cuda"]) == torch.cuda.device_count():
        torch.cuda.set_rng_state_all(rng["cuda"])
    np.random.set_state(_decode(doc["numpy_random"], arrays))
    random.setstate(_decode(doc["python_random"], arrays))
    if buffer is not None:
        if doc["buffer"] is None:
            raise CheckpointError(f"{path} holds no experience buffer")
        buffer.load_state_dict(_decode(doc["buffer"], arrays))
    return {**_decode(doc["state"], arrays), "step": doc["step"]}


def verify_checkpoint(path: Path) -> str | None:
    """None if `path` is a complete checkpoint matching its manifest, else why it is not."""
    try:
        manifest = json.loads((Path(path) / "manifest.json").read_text())
        files = manifest["files"]
    except FileNotFoundError:
        return "no manifest.json (partial write)"
    except (ValueError, KeyError, TypeError) as e:
        return f"unreadable manifest.json ({e!r})"
    for required in ("state.json", "arrays.npz", "optimizer.pt", "rng.pt"):
        if required not in files:
            return f"manifest lists no {required}"
    if (m := _NAME.match(Path(path).name)) and int(m.group(1)) != manifest.get("step"):
        return f"manifest is for step {manifest.get('step')}"
    try:
        for rel, meta in files.items():
            p = Path(path) / rel
            if not p.is_file():
                return f"{rel} is missing"
            if p.stat().st_size != meta["size"]:
                return f"{rel} has {p.stat().st_size} bytes, the manifest says {meta['size']}"
            if _sha256(p) != meta["sha256"]:
                return f"{rel} fails its sha256 check"
    except (KeyError, TypeError, AttributeError) as e:
        return f"malformed manifest entry ({e!r})"
    return None


def latest_valid(ckpt_root: Path) -> Path | None:
    """The newest checkpoint under `ckpt_root` that verifies; newer broken ones are skipped with a warning."""
    for step, path in sorted(_checkpoints(Path(ckpt_root)), reverse=True):
        why = verify_checkpoint(path)
        if why is None:
            return path
        log.warning("skipping checkpoint %s: %s", path, why)
    return None


def pack_ragged(d: dict[int, list[int]]) -> dict:
    """A dict of int lists (e.g. question id -> prompt token ids) as three arrays, for compact storage."""
    keys = list(d)
    return {"keys": np.array(keys, np.int64), "lengths": np.array([len(d[k]) for k in keys], np.int64),
            "values": np.array([v for k in keys for v in d[k]], np.int64)}


def unpack_ragged(packed: dict) -> dict[int, list[int]]:
    ends = np.cumsum(packed["lengths"]).tolist()
    values = packed["values"].tolist()
    return {k: values[e - n:e] for k, n, e in zip(packed["keys"].tolist(), packed["lengths"].tolist(), ends)}


# ----------------------------------------------------------------------------- internals
def _encode(obj: Any, arrays: dict[str, np.ndarray]) -> Any:
    """JSON-able form of `obj`; arrays move to `arrays`, tuples and non-str-keyed dicts are tagged so
    they come back as they were."""
    if isinstance(obj, np.ndarray):
        if obj.dtype.hasobject:
            raise TypeError("object arrays cannot be saved without pickle")
        name = f"a{len(arrays)}"
        arrays[name] = obj
        return {"__array__": name}
    if isinstance(obj, np.generic):
        return obj.item()
    if isinstance(obj, tuple):
        return {"__tuple__": [_encode(x, arrays) for x in obj]}
    if isinstance(obj, list):
        return [_encode(x, arrays) for x in obj]
    if isinstance(obj, dict):
        if all(isinstance(k, str) for k in obj):
            if len(obj) == 1 and next(iter(obj)) in _MARKERS:
                raise ValueError(f"state key {next(iter(obj))!r} is reserved")
            return {k: _encode(v, arrays) for k, v in obj.items()}
        return {"__items__": [[_encode(k, arrays), _encode(v, arrays)] for k, v in obj.items()]}
    if obj is None or isinstance(obj, (str, int, float, bool)):
        return obj
    raise TypeError(f"cannot checkpoint a {type(obj).__name__} without pickle")


def _decode(obj: Any, arrays: dict[str, np.ndarray]) -> Any:
    if isinstance(obj, list):
        return [_decode(x, arrays) for x in obj]
    if isinstance(obj, dict):
        if len(obj) == 1 and (tag := next(iter(obj))) in _MARKERS:
            v = obj[tag]
            if tag == "__array__":
                return arrays[v]
            if tag == "__tuple__":
                return tuple(_decode(x, arrays) for x in v)
            return {_freeze(_decode(k, arrays)): _decode(x, arrays) for k, x in v}
        return {k: _decode(v, arrays) for k, v in obj.items()}
    return obj


def _freeze(k: Any) -> Any:
    return tuple(_freeze(x) for x in k) if isinstance(k, (list, tuple)) else k


def local_full_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> tuple[dict, dict]:
    """The weights and optimizer state of an unsharded model, by parameter name."""
    opts = StateDictOptions(full_state_dict=True)
    return get_model_state_dict(model, options=opts), get_optimizer_state_dict(model, optimizer, options=opts)


def read_training_state(path: Path, model: torch.nn.Module, optimizer: bool = True) -> tuple[dict, dict | None]:
    """The saved weights (tied aliases filled in) and optimizer state of checkpoint `path`, for
    `set_model_state_dict` / `set_optimizer_state_dict`; checks the weights fit `model`."""
    from safetensors.torch import load_file

    folder = Path(path) / "model"
    saved: dict[str, torch.Tensor] = {}
    for f in sorted(folder.glob("*.safetensors")):
        saved.update(load_file(str(f)))
    if not saved:
        raise CheckpointError(f"{folder} holds no safetensors weights")
    names: dict[int, list[str]] = {}  # parameter -> every name it has (tied weights have two)
    for n, p in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), []).append(n)
    own = {n for n, _ in model.named_parameters(remove_duplicate=False)} | {n for n, _ in model.named_buffers()}
    for aliases in names.values():
        src = next((a for a in aliases if a in saved), None)
        for a in aliases:
            if src is not None and a not in saved:
                saved[a] = saved[src]
    missing = sorted(n for n in own if n not in saved and not n.endswith("inv_freq"))
    unexpected = sorted(set(saved) - own)
    if missing or unexpected:
        raise CheckpointError(f"{folder} does not fit the model: missing {missing[:5]}, unexpected {unexpected[:5]}")
    optim = torch.load(Path(path) / "optimizer.pt", map_location="cpu", weights_only=True) if optimizer else None
    return saved, optim


def _checkpoints(root: Path) -> list[tuple[int, Path]]:
    if not root.is_dir():
        return []
    return [(int(m.group(1)), p) for p in root.iterdir() if p.is_dir() and (m := _NAME.match(p.name))]


def _prune(root: Path, step: int, keep_last: int) -> None:
    """Delete checkpoints beyond the newest `keep_last` up to `step`, and any of a later step: those
    belong to a history abandoned by resuming from an earlier one. Also clears dot-folder debris."""
    kept = sorted((s for s in _checkpoints(root) if s[0] <= step), reverse=True)[:max(1, keep_last)]
    for s, p in _checkpoints(root):
        if (s, p) not in kept:
            shutil.rmtree(p)
    for p in root.iterdir():
        if p.name.startswith((".tmp-step-", ".trash-step-")):
            shutil.rmtree(p, ignore_errors=True)


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            h.update(chunk)
    return h.hexdigest()


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_synced(path: Path, text: str) -> None:
    with open(path, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
