"""The shipped 8-GPU configs rehearsed on CPU (`exgrpo-async train --config C --rehearse`, exgrpo_async/launcher/rehearse.py).

Each config runs its own process topology and code path at the toy shape: its GPU plan (every process
started with the CUDA_VISIBLE_DEVICES the node would give it), its learner ranks (FSDP2 over gloo, the
bf16 recipe, gradient checkpointing where the config asks for it, packed micro-batches), its actors' tensor-parallel engines, its data
format (verl parquet rows with the system prompt, a bad row skipped and counted), ExGRPO, evaluation
with the best-weights rule that leaves Minerva out, checkpoints, and `train --resume` (at 4 ranks: the
last checkpoint's shards loaded and gathered back exactly; one rank's resume is test_resume.py's). Only
the kernels differ (and the number of actors: one, of the config's kind). The 7B rehearsal's TP-2 actor
is also the suite's tensor-parallel `train` run: both workers in the weight-sync group, every load
fingerprinted as the workers' shares.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from exgrpo_async.config_io import load_config
from exgrpo_async.launcher.rehearse import EVAL_SOURCES, STEPS
from tests.integration.conftest import TOY
from tests.integration.helpers import cli

pytestmark = pytest.mark.slow  # a 4-step run (and the 7B's resume): 1-3 min each

REPO = Path(__file__).resolve().parents[2]
# the evaluation before the first step is the other runs' (test_full_run.py): 5-10 s each here, and the
# override shows that a key the user sets is left as set
NO_EVAL_BEFORE = "learner.eval_before=false"


def rows_of(run_dir: Path) -> tuple[list[dict], list[dict]]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line]
    return [r for r in rows if "eval" not in r], [r for r in rows if "eval" in r]


@pytest.mark.parametrize("name", ["qwen2.5-math-7b-8gpu", "qwen2.5-math-1.5b-8gpu"])
def test_a_gpu_config_rehearses_on_cpu_then_resumes(name, toy, tmp_path):
    config = REPO / "configs" / f"{name}.toml"
    node = load_config(config)
    L, tp = node.learner, node.actor.engine.tensor_parallel_size
    proc = subprocess.run(cli(["train", "--config", str(config), "--rehearse", *TOY, "metrics.port=none", NO_EVAL_BEFORE,
                              f"output_dir={tmp_path / 'runs'}"]),
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    # the node's plan, and each process started with its share of it
    learner_gpus = ",".join(map(str, range(L.world_size)))
    assert f"learner ({L.world_size} rank(s)): GPUs {learner_gpus}" in proc.stdout
    assert f"learner ranks: CUDA_VISIBLE_DEVICES={learner_gpus}" in proc.stderr
    actor_gpus = ",".join(map(str, range(L.world_size, L.world_size + tp)))
    assert f"actor 1: CUDA_VISIBLE_DEVICES={actor_gpus}" in proc.stderr
    assert "actor 2: CUDA_VISIBLE_DEVICES" not in proc.stderr  # one actor of the config's kind
    if tp > 1:
        assert f"weight-sync group of {1 + tp} (tensor parallel {tp})" in proc.stderr
    (run_dir,) = list((tmp_path / "runs").glob("run-*"))
    cfg = json.loads((run_dir / "config.json").read_text())
    # what the rehearsal kept from the config: the topology and the numerical recipe
    assert cfg["learner"]["world_size"] == L.world_size and cfg["actor"]["engine"]["tensor_parallel_size"] == tp
    assert cfg["learner"]["gradient_checkpointing"] == node.learner.gradient_checkpointing
    assert cfg["learner"]["compile"] == node.learner.compile and cfg["learner"]["mixed_precision"] == "bf16"
    assert cfg["model"]["dtype"] == node.model.dtype == "bfloat16"
    assert cfg["data"]["system_prompt"] == node.data.system_prompt and cfg["data"]["use_chat_template"]
    assert cfg["learner"]["best_exclude_sources"] == ["minerva"] and cfg["exgrpo"]["enabled"]
    assert (cfg["weight_sync"]["backend"], cfg["learner"]["device"], cfg["placement"]["rehearse"]) == ("gloo", "cpu", True)
    assert not cfg["learner"]["eval_before"] and "held-out before" not in proc.stderr

    steps, evals = rows_of(run_dir)
    assert [r["step"] for r in steps] == list(range(1, STEPS + 1))
    assert all(r["rollouts"] == cfg["learner"]["questions_per_step"] * node.rollout.samples_per_question for r in steps)
    assert any(r.get("selected_entropy_mean") is not None for r in steps), "ExGRPO's selection never ran"
    assert [e["step"] for e in evals] == [2]  # every 2 steps, the last step's evaluation is the summary's
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["questions_unaccounted"] == 0 and summary["data_rows_skipped"] == 1
    assert summary["before"] is None and [p["step"] for p in summary["held_out_curve"]] == [2, STEPS]
    # every sync reached the actor's every worker, and the engine's fingerprint (its workers' shares
    # combined, under TP) matched what was sent, every time. Loads: version 0 and the two evaluations'
    # (2 and 4) at least; not one per step, as an actor asking while the learner made two steps loads only
    # the newer version
    assert summary["actors_lost"] == 0 and summary["fingerprints_checked"] == summary["syncs"] >= 3
    assert summary["weight_fingerprint_mismatches"] == 0 and summary["fingerprints_unchecked"] == 0
    for ev in (evals[0]["eval"], summary["after"]):
        assert set(ev["by_source"]) == set(EVAL_SOURCES.values())
        kept = [acc for src, acc in ev["by_source"].items() if src != "minerva"]
        assert ev["score"] == pytest.approx(sum(kept) / len(kept))  # Minerva left out of the best-weights score
    # the best weights: the first evaluation, unless the final one scored higher
    best_step = 2 if evals[0]["eval"]["score"] >= summary["after"]["score"] else STEPS
    assert (summary["best"]["step"], summary["best"]["excluded"]) == (best_step, ["minerva"])
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir() if p.name.startswith("step-")) == \
        [f"step-{s:06d}" for s in (2, 4)]

    if L.world_size == 1:  # a one-rank learner's resume is test_resume.py's and the 2-rank drill's
        return
    # the rehearsed run resumes as one (its config.json), on the same topology: its ranks take their shards
    # of the last checkpoint from the lead and gather them back into final/. No step and no actor (the
    # steps after a resume are test_resume.py's, the drill's and, at 2 ranks, test_learner_ranks.py's),
    # so the final weights must be the checkpoint's exactly (in the config's bf16): the first run's final/
    # holds the same weights, so it goes first, and the resumed run must write its own
    shutil.rmtree(run_dir / "final")
    resumed = subprocess.run(cli(["train", "--resume", str(run_dir), f"learner.max_steps={STEPS}", "actor.num_actors=0",
                                  "data.eval_file=none"]), capture_output=True, text=True, timeout=600)
    assert resumed.returncode == 0, resumed.stderr[-4000:]
    assert re.search(rf"resumed from \S*step-{STEPS:06d}: step {STEPS},", resumed.stderr), resumed.stderr[-3000:]
    assert f"learner ranks: CUDA_VISIBLE_DEVICES={learner_gpus}" in resumed.stderr
    steps, _ = rows_of(run_dir)
    assert [r["step"] for r in steps] == list(range(1, STEPS + 1))
    assert json.loads((run_dir / "summary.json").read_text())["questions_unaccounted"] == 0
    final = load_file(run_dir / "final" / "model.safetensors")
    saved = load_file(run_dir / "checkpoints" / f"step-{STEPS:06d}" / "model" / "model.safetensors")
    assert final.keys() == saved.keys() and {t.dtype for t in final.values()} == {torch.bfloat16}
    assert all(torch.equal(final[k], saved[k].to(torch.bfloat16)) for k in saved)
