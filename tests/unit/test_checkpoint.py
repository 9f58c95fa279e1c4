"""Checkpoints: exact round trips of every piece of learner state, atomic writes, keep-last pruning."""

import itertools
import json
import logging
import random

import numpy as np
import pytest
import torch

from exgrpo_async.data import QuestionSampler
from learner.checkpoint import (
    CheckpointError,
    latest_valid,
    load_checkpoint,
    pack_ragged,
    save_checkpoint,
    unpack_ragged,
    verify_checkpoint,
)
from learner.dispatch import Dispatcher
from learner.maths.buffer import ExperienceBuffer, Trajectory
from learner.model import load_policy


def traj(rng, version=0):
    n = rng.randint(1, 12)
    return Trajectory(np.array([rng.randrange(100) for _ in range(n)], np.int32),
                      np.array([-rng.random() for _ in range(n)], np.float32), version)


def filled_buffer(seed=0, cap=None):
    """A buffer that has been through records, duplicates, retirements, end_step and FIFO eviction."""
    rng = random.Random(seed)
    b = ExperienceBuffer(K=8, max_trajectories=cap, seed=seed)
    for step in range(6):
        for q in rng.sample(range(40), 12):
            t = traj(rng, step)
            b.record(q, rng.randint(0, 8), [t, t, traj(rng, step)])
        b.end_step()
        b.sample_questions(5)  # the rng moves on
    b.record(7, 3, [])  # a question in a bucket with no trajectory of its own
    return b


def history(b: ExperienceBuffer, seed: int) -> list:
    """What a buffer does from here on: samples of both weightings interleaved with more records."""
    rng, out = random.Random(seed), []
    for step in range(5):
        out.append(b.sample_questions(6))
        out.append(b.sample_questions(3, weighting="uniform"))
        for q in rng.sample(range(60), 8):
            b.record(q, rng.randint(0, 8), [traj(rng, 10 + step)])
        b.end_step()
        out.append((b.bucket_sizes(), b.num_trajectories, b.num_tokens, b.evicted, sorted(b.retired)))
        out.append({q: [(t.token_ids.tolist(), t.logprobs.tolist(), t.version) for t in b.trajectories(q)]
                    for q in range(60)})
    return out


@pytest.fixture
def policy(tiny_tied):
    return load_policy(str(tiny_tied), "float32", torch.device("cpu"))


def train_step(model, opt, seed):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, 100, (2, 10), generator=g)
    loss = model(input_ids=ids, labels=ids).loss
    opt.zero_grad()
    loss.backward()
    opt.step()


def save(root, step, policy, state=None, buffer=None, keep_last=10):
    model, tok = policy
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    return save_checkpoint(root, step, model, tok, opt, state or {"x": step}, buffer, keep_last)


@pytest.mark.parametrize("cap", [None, 25])
def test_buffer_continues_exactly_after_a_restore(tmp_path, policy, cap):
    a, b = filled_buffer(cap=cap), filled_buffer(cap=cap)
    assert cap is None or a.evicted > 0
    model, tok = policy
    path = save_checkpoint(tmp_path, 1, model, tok, torch.optim.AdamW(model.parameters()), {}, a)
    restored = ExperienceBuffer(K=8, seed=123)  # a different seed: the saved rng must win
    load_checkpoint(path, model, None, restored)
    assert restored._buckets == b._buckets and restored._pos == b._pos and restored._fifo == b._fifo
    assert restored._keys == b._keys and restored.retired == b.retired and list(restored._traj) == list(b._traj)
    assert history(restored, 5) == history(b, 5)


def test_buffer_without_a_checkpoint_diverges_under_another_seed():
    """The history comparison above can fail: a buffer with another rng state samples differently."""
    a, b = filled_buffer(), filled_buffer()
    b.rng.seed(99)
    assert history(a, 5) != history(b, 5)


def test_model_optimizer_and_rngs_round_trip(tmp_path, tiny_untied):
    model, tok = load_policy(str(tiny_untied), "float32", torch.device("cpu"))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.99))
    train_step(model, opt, 0)
    loop_rng = random.Random(4)
    loop_rng.random()
    torch.manual_seed(11), np.random.seed(12), random.seed(13)
    path = save_checkpoint(tmp_path, 3, model, tok, opt, {"rng": loop_rng.getstate()})
    expect = (torch.rand(3).tolist(), np.random.rand(3).tolist(), random.random(), loop_rng.random())
    train_step(model, opt, 1)
    want = {n: p.detach().clone() for n, p in model.named_parameters()}

    other, _ = load_policy(str(tiny_untied), "float32", torch.device("cpu"))
    with torch.no_grad():
        for p in other.parameters():
            p.add_(1.0)
    opt2 = torch.optim.AdamW(other.parameters(), lr=5.0)
    torch.manual_seed(0), np.random.seed(0), random.seed(0)
    state = load_checkpoint(path, other, opt2)
    r2 = random.Random()
    r2.setstate(state["rng"])
    assert (torch.rand(3).tolist(), np.random.rand(3).tolist(), random.random(), r2.random()) == expect
    assert state["step"] == 3 and opt2.param_groups[0]["lr"] == 1e-3
    train_step(other, opt2, 1)  # the same update from the restored weights and Adam moments
    for n, p in other.named_parameters():
        assert torch.equal(p, want[n]), n


def test_loop_state_keeps_its_types(tmp_path, policy):
    rng = random.Random(1)
    state = {"version": 7, "mixed": True, "totals": {"rollouts": 5, "loss": float("inf")}, "rng": rng.getstate(),
             "bucket_at_selection": {3: 2, 9: None}, "pairs": [(1, "a")], "arr": np.arange(5, dtype=np.float32),
             "prompt_ids_of": pack_ragged({4: [1, 2, 3], 8: [], 2: [9]})}
    path = save(tmp_path, 1, policy, state)
    got = load_checkpoint(path, policy[0])
    assert got["bucket_at_selection"] == {3: 2, 9: None} and got["pairs"] == [(1, "a")] and got["rng"] == rng.getstate()
    assert got["arr"].dtype == np.float32 and got["arr"].tolist() == [0, 1, 2, 3, 4]
    assert unpack_ragged(got["prompt_ids_of"]) == {4: [1, 2, 3], 8: [], 2: [9]}
    assert got["totals"] == {"rollouts": 5, "loss": float("inf")} and got["mixed"] is True and got["version"] == 7
    with pytest.raises(TypeError):
        save(tmp_path, 2, policy, {"x": object()})


def test_dispatcher_requeues_in_flight_work(tmp_path, policy):
    sampler = QuestionSampler(range(20), seed=3)
    d = Dispatcher(sampler.next, questions_per_step=4, samples=8, temperature=1.0, max_staleness=1,
                   exclude_questions=sampler.exclude)
    first = d.take("a", 0, 6)
    replay = Trajectory(np.array([5, 6], np.int32), np.array([-0.5, -0.25], np.float32), 1)
    d.add_experience([(first[0].question_id, replay), (99, replay)], n=7)
    d.add_eval([0, 1], 4, 0.5, 0)
    done = [d.complete(w.work_id) for w in first[:4]]  # trained on: gone for good
    d.trained(4, version=1)
    more = d.take("b", 1, 5)  # two eval, both experience items, one training question
    assert [w.purpose for w in more] == ["eval", "eval", "train", "train", "train"] and more[4].replay is None
    d.add_experience([(55, replay)], n=7)  # queued, not yet taken
    received = [d.complete(more[4].work_id)]  # in the loop's inbox when the checkpoint is taken
    d.complete(first[4].work_id)
    d.reissue(first[4])  # its rollouts could not be used
    assert d.experience_in_flight() == {first[0].question_id, 99, 55}
    path = save(tmp_path, 1, policy, {"dispatcher": d.state_dict(received, sampler)})
    in_flight_train = [first[5].question_id, more[4].question_id]

    s2 = QuestionSampler(range(20), seed=3)
    d2 = Dispatcher(s2.next, 4, 8, 1.0, 1, s2.exclude)
    d2.load_state_dict(load_checkpoint(path, policy[0])["dispatcher"], s2)
    assert d2.version == 1 and d2.train_dispatched == d2.train_consumed == 4 and not d2.outstanding
    assert d2.experience_in_flight() == {first[0].question_id, 99, 55}  # open counts rebuilt from the queue
    got = d2.take("c", 1, 100)
    assert len(got) == 2 * 4  # (version + 1 + max_staleness) * B minus the 4 trained: nothing in flight
    # experience: the dispatched ones in dispatch order, then the queued one
    assert [w.question_id for w in got[:3]] == [done[0].question_id, 99, 55]
    assert all(np.array_equal(w.replay.token_ids, replay.token_ids) and w.replay.version == 1 for w in got[:3])
    assert got[0].replay.logprobs.dtype == np.float32 and got[0].n == 7 and not any(w.purpose == "eval" for w in got)
    assert [w.question_id for w in got[3:6]] == [first[4].question_id] + in_flight_train  # retry queue, then in flight
    assert [w.question_id for w in got[6:]] == [sampler.next() for _ in range(2)]  # the sampler went on from its save
    assert min(w.work_id for w in got) > max(w.work_id for w in first + more)


def test_latest_valid_skips_partial_and_corrupt_checkpoints(tmp_path, policy, caplog):
    paths = [save(tmp_path, s, policy) for s in (1, 2, 3)]
    assert latest_valid(tmp_path) == paths[2]
    (paths[2] / "manifest.json").unlink()
    with caplog.at_level(logging.WARNING):
        assert latest_valid(tmp_path) == paths[1]
    assert "step-000003" in caplog.text and "manifest" in caplog.text
    caplog.clear()
    f = paths[1] / "optimizer.pt"
    f.write_bytes(f.read_bytes()[:-10])  # truncated
    with caplog.at_level(logging.WARNING):
        assert latest_valid(tmp_path) == paths[0]
    assert "step-000002" in caplog.text and "optimizer.pt" in caplog.text
    weights = next(paths[0].glob("model/*.safetensors"))
    data = bytearray(weights.read_bytes())
    data[-1] ^= 0xFF  # same size, one bit pattern changed
    weights.write_bytes(bytes(data))
    assert "sha256" in verify_checkpoint(paths[0])
    assert latest_valid(tmp_path) is None
    with pytest.raises(CheckpointError):
        load_checkpoint(paths[0], policy[0])
    (tmp_path / ".tmp-step-000004").mkdir()  # debris of a crashed save is never a candidate
    assert latest_valid(tmp_path / "nowhere") is None and latest_valid(tmp_path) is None


def test_manifest_lists_every_file_with_its_hash(tmp_path, policy):
    path = save(tmp_path, 5, policy, buffer=filled_buffer())
    manifest = json.loads((path / "manifest.json").read_text())
    files = {p.relative_to(path).as_posix() for p in path.rglob("*") if p.is_file()} - {"manifest.json"}
    assert manifest["step"] == 5 and set(manifest["files"]) == files
    assert {"model/config.json", "state.json", "arrays.npz", "optimizer.pt", "rng.pt"} <= files
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]


def test_keep_last_prunes_older_and_abandoned_checkpoints(tmp_path, policy):
    for s in range(1, 5):
        save(tmp_path, s, policy, keep_last=2)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-000003", "step-000004"]
    save(tmp_path, 4, policy, {"x": "again"}, keep_last=2)  # the same step again replaces it
    assert load_checkpoint(tmp_path / "step-000004", policy[0])["x"] == "again"
    save(tmp_path, 2, policy, keep_last=2)  # resumed from an earlier step: later ones are another history
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-000002"]
    save(tmp_path, 3, policy, keep_last=3)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-000002", "step-000003"]


def test_work_ids_never_collide_across_restarts():
    d = Dispatcher(itertools.count().__next__, 4, 8, 1.0, 1)
    old = d.take("a", 0, 8)
    state = d.state_dict()
    d.trained(4, version=1)
    assert d.take("a", 1, 8)  # handed out after the checkpoint, before the crash
    d2 = Dispatcher(itertools.count().__next__, 4, 8, 1.0, 1)
    d2.load_state_dict(state)
    assert min(w.work_id for w in d2.take("b", 0, 8)) > max(w.work_id for w in old) + 10**9


def test_final_export_is_written_in_the_actors_dtype_from_fp32_master_weights(tiny_tied, tmp_path):
    from safetensors.torch import load_file

    from learner.model import save_policy

    model, tok = load_policy(str(tiny_tied), "float32", torch.device("cpu"))
    save_policy(model, tok, tmp_path / "final", "bfloat16")
    tensors = load_file(str(tmp_path / "final" / "model.safetensors"))
    assert {t.dtype for t in tensors.values()} == {torch.bfloat16}
    assert next(model.parameters()).dtype == torch.float32  # the master weights are untouched
    again, _ = load_policy(str(tmp_path / "final"), "bfloat16", torch.device("cpu"))
    ref = dict(model.named_parameters())
    for n, p in again.named_parameters():
        torch.testing.assert_close(p.float(), ref[n].detach().to(torch.bfloat16).float())
