"""The learner's memory model against measured steps, and the GPU plan it gives the 7B config."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from learner.maths.memory_model import LLAMA31_8B, QWEN25_05B, QWEN25_7B, gpus_needed, rank_bytes, step_peak_bytes

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.slow  # a real step at the 0.5B shape in a fresh process: 30-50 s on 2 busy cores
@pytest.mark.parametrize("path,tokens", [("new", 1024)])
def test_memory_model_predicts_a_measured_step(path, tokens):
    """One real step at the Qwen2.5-0.5B shape (1 layer), in a fresh process (ops/bench/system/learner_memory.py),
    on the path the learner uses; the old full-logits path and more lengths and layers are measured against
    the model by the benchmark itself (`ops/bench/system/learner_memory.py`, docs/memory.md)."""
    proc = subprocess.run([sys.executable, str(REPO / "ops/bench/system/learner_memory.py"), "--child", path, str(tokens),
                           "--layers", "1", "--threads", "2"], capture_output=True, text=True, cwd=REPO, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    measured = json.loads(proc.stdout.strip().splitlines()[-1])["step_peak_bytes"]
    predicted = step_peak_bytes(QWEN25_05B, tokens, layers=1, path=path)
    assert 0.85 <= predicted / measured <= 1.25, (predicted, measured)


def test_chunked_path_grows_with_tokens_far_slower_than_the_full_logits_path():
    old = step_peak_bytes(QWEN25_05B, 8192, path="old") - step_peak_bytes(QWEN25_05B, 4096, path="old")
    new = step_peak_bytes(QWEN25_05B, 8192, path="new") - step_peak_bytes(QWEN25_05B, 4096, path="new")
    assert old > 10 * new > 0


def test_seven_b_trains_8k_sequences_on_at_most_four_80gb_gpus():
    assert gpus_needed(QWEN25_7B, 8192) <= 4 and gpus_needed(LLAMA31_8B, 8192) <= 4
    assert rank_bytes(QWEN25_7B, 8192, 1) > 80e9  # it does not fit one: sharding is what makes it fit
