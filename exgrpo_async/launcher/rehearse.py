"""Rehearse a GPU config on CPU: `exgrpo-async train --config configs/qwen2.5-math-7b-8gpu.toml --rehearse`.

Job: turn a multi-GPU run's config into one this machine runs with the same process topology and code
path, so what would crash on the node's first contact crashes here first. Kept from the config: the
GPU plan (every process gets the CUDA_VISIBLE_DEVICES the node would give it, from the same plan), the
learner's ranks (FSDP2, gradient checkpointing, the mixed-precision recipe, minibatches, packed
micro-batches), the actors' tensor-parallel engines in their own processes, the data format (verl
parquet rows with the config's system prompt, bad rows skipped and counted), the chat-template path,
the verifier's workers, ExGRPO, evaluation with its best-checkpoint rule, checkpoints and resume.
Replaced, each named with its reason in `changes` (which `train` prints): the model (the toy policy),
lengths and batch sizes (toy shapes), CUDA-only settings (device, NCCL, CUDA graphs), and on a small
machine the number of actors (never the kinds of process). Only the kernels differ.
A rehearsed run records `placement.rehearse = true` in its config.json, so `train --resume RUN_DIR`
rehearses too.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from exgrpo_async.config import RunConfig
from exgrpo_async.config_io import load_config, with_values
from exgrpo_async.launcher.placement import Plan, plan

STEPS = 4  # two evaluations and two checkpoints (every 2 steps), the last of them at the end
# The toy policy reads "<bos>" + the question: the template renders the user message alone (the system
# prompt is set on the rows by the config's own path, then dropped here, where the policy would not read it)
TOY_CHAT_TEMPLATE = ("{%- for m in messages -%}{%- if m['role'] == 'user' -%}<bos>{{ m['content'] }}"
                     "{%- endif -%}{%- endfor -%}")
# the toy test kinds under the held-out mix's source names, minerva among them (best_exclude_sources)
EVAL_SOURCES = {"add2": "math500", "add3": "aime24", "mul21": "minerva", "sub2": "amc", "addmul": "olympiad_bench"}
EVAL_PER_SOURCE = 2
TRAIN_QUESTIONS = 400


def node_plan(cfg: RunConfig) -> Plan:
    """The config's GPU plan on its node (`placement.gpus`, else just the GPUs the plan needs)."""
    need = cfg.learner.world_size + (cfg.actor.num_actors or 0) * cfg.actor.engine.tensor_parallel_size
    gpu_plan = plan(cfg, cfg.placement.gpus or need) if cfg.learner.device == "cuda" or cfg.placement.gpus else None
    if gpu_plan is None:
        raise ValueError("--rehearse rehearses a GPU config (learner.device = \"cuda\", placement.gpus > 0); "
                         "a CPU config runs as it is")
    return gpu_plan


def rehearsal(path: str | None, overrides: list[str], actors: int = 1) -> tuple[RunConfig, Plan, list[str]]:
    """(the rehearsal's config, the node's plan, one line per replaced setting). `overrides` apply to the
    config (the run the node would do), and the rehearsal leaves every key they set as they set it."""
    node = load_config(path, overrides)
    gpu_plan = node_plan(node)
    user = {item.split("=", 1)[0].strip() for item in overrides}
    out = Path(node.output_dir if "output_dir" in user else node.output_dir + "-rehearsal")
    train, valid = write_data(node, out / "data")
    from exgrpo_async.toy.task import ensure_toy_assets

    toy = ensure_toy_assets(Path(node.toy.cache_dir), node.toy.seed, node.toy.sft_steps, threads=node.toy.sft_threads)
    L, A = node.learner, node.actor
    changes: list[tuple[str, Any, str]] = [
        ("model.path", str(toy["model"]), "the toy policy (a real shape's memory and speed are ops/bench's)"),
        ("model.max_model_len", 256, "toy lengths"),
        ("rollout.max_new_tokens", 64, "toy lengths"),
        ("data.train_files", [str(train)], f"{TRAIN_QUESTIONS} toy questions as verl rows with the config's system "
                                           "prompt, and one malformed row"),
        ("data.eval_file", str(valid), "toy held-out questions as verl rows, sources named as the held-out mix's"),
        ("data.chat_template", TOY_CHAT_TEMPLATE, "the toy policy reads '<bos>' + the question"),
        ("actor.verifier.require_think", False, "the toy policy does not write <think>"),
        ("learner.device", "cpu", "no GPU here"),
        ("weight_sync.backend", "gloo", "NCCL needs GPUs; the same broadcast code runs on gloo"),
        ("actor.engine.enforce_eager", True, "CUDA graphs are a GPU kernel"),
        ("actor.num_actors", min(A.num_actors or len(gpu_plan.actors), actors),
         f"the node's plan has {len(gpu_plan.actors)}; this machine hosts fewer (the same kind of process)"),
        ("actor.pin_cores", False, "a GPU run gives each actor a slice of the node's cores; a small machine has no slices"),
        ("learner.questions_per_step", 2 * L.minibatches_per_step, "toy batch"),
        ("rollout.questions_per_request", 2 * L.minibatches_per_step,
         "toy batch: a step's questions in one request (fewer, fuller decode steps: 15% less wall at 7B's TP 2)"),
        ("learner.max_tokens_per_micro_batch", 128, "toy budget: several packed micro-batches per rank, as at full size"),
        ("learner.max_steps", STEPS, "a few steps"),
        ("learner.eval_every", 2, "an evaluation inside the run"),
        ("learner.checkpoint_every", 2, "a checkpoint inside the run"),
        ("exgrpo.start_threshold", 0.0, "ExGRPO switches on at the first correct sample, so replay runs within the steps"),
        ("placement.rehearse", True, "every process gets the node's CUDA_VISIBLE_DEVICES; no CUDA device is needed"),
        ("output_dir", str(out), "rehearsals beside the real runs, not among them; the data in its data/"),
    ]
    kept = [(k, v, why) for k, v, why in changes if k not in user]
    cfg = with_values(node, {k: v for k, v, _ in kept})
    return cfg, gpu_plan, [f"{k} = {_short(v)}: {why}" for k, v, why in kept]


def _short(value: Any) -> str:
    text = json.dumps(value)
    return text if len(text) <= 60 else text[:57] + "..."


def write_data(cfg: RunConfig, folder: Path) -> tuple[Path, Path]:
    """The toy task in the config's data format: verl parquet rows (system + user messages,
    reward_model.ground_truth, data_source), the training file with one malformed row at the end."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from exgrpo_async.toy.task import TEST_KINDS, make_test_set, make_train_set

    folder.mkdir(parents=True, exist_ok=True)
    system = [{"role": "system", "content": cfg.data.system_prompt}] if cfg.data.system_prompt else []

    def row(r: dict, source: str) -> dict:
        return {"data_source": source, "prompt": system + [{"role": "user", "content": r["problem"]}],
                "reward_model": {"ground_truth": r["answer"]}}

    held_out = make_test_set(seed=cfg.toy.seed)  # the toy's held-out set: none of it is trained on
    exclude = {r["problem"] for r in held_out}
    test = [r for kind in TEST_KINDS for r in [x for x in held_out if x["kind"] == kind][:EVAL_PER_SOURCE]]
    train_rows = [row(r, "toy") for r in make_train_set(cfg.toy.seed + 1, TRAIN_QUESTIONS, exclude)]
    bad = {"data_source": "toy", "prompt": system + [{"role": "user", "content": "1+1="}], "reward_model": {}}
    train, valid = folder / "train.parquet", folder / "valid.parquet"
    pq.write_table(pa.Table.from_pylist(train_rows + [bad]), train)
    pq.write_table(pa.Table.from_pylist([row(r, EVAL_SOURCES[r["kind"]]) for r in test]), valid)
    return train, valid
