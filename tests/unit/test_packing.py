"""Packed rows and token-budget micro-batches: the same log-probs, loss and gradients as padded rows."""

import pytest
import torch

from exgrpo_async.toy.task import build_model
from learner.maths.grpo import behaviour_weights, rows_logprobs
from learner.maths.packing import micro_batches, pack_rows, pad_rows
from tests.unit.test_update import _cfg, _run, _seqs


def test_pad_rows_mark_positions_that_predict_completion_tokens():
    r = pad_rows([[1, 2, 3], [1]], [[7, 8], [9, 9, 9]], pad_id=0)
    assert r.input_ids.tolist() == [[1, 2, 3, 7, 8], [1, 9, 9, 9, 0]]
    assert r.attention_mask.tolist() == [[1, 1, 1, 1, 1], [1, 1, 1, 1, 0]]
    # logits at position j score token j+1: row 0 scores 7 at j=2 and 8 at j=3
    assert r.target_mask.tolist() == [[False, False, True, True], [True, True, True, False]]
    assert r.place([torch.tensor([-1.0, -2.0]), torch.tensor([-3.0, -4.0, -5.0])]).tolist() == [
        [0.0, 0.0, -1.0, -2.0], [-3.0, -4.0, -5.0, 0.0]]


def test_pack_rows_put_sequences_back_to_back_with_restarting_positions():
    r = pack_rows([[1, 2], [1], [1, 2, 3]], [[5, 6], [7], [8]], pad_id=0, max_tokens=6)
    assert r.input_ids.tolist() == [[1, 2, 5, 6, 1, 7], [1, 2, 3, 8, 0, 0]]
    assert r.position_ids.tolist() == [[0, 1, 2, 3, 0, 1], [0, 1, 2, 3, 0, 1]]
    assert r.attention_mask is None
    assert r.seq_index.tolist() == [[-1, 0, 0, -1, 1], [-1, -1, 2, -1, -1]]
    vals = torch.arange(10.0).view(2, 5)
    assert [v.tolist() for v in r.split(vals)] == [[1.0, 2.0], [4.0], [7.0]]
    assert r.per_token(torch.tensor([1.0, 2.0, 3.0])).tolist() == [[0, 1, 1, 0, 2], [0, 0, 3, 0, 0]]


def test_target_positions_go_to_an_accelerator_once_per_layout():
    # `place` and `split` run several times per micro-batch; the positions they index by are copied over
    # once ("meta" stands in for an accelerator: shapes without data)
    r = pack_rows([[1, 2], [1]], [[5, 6], [7]], pad_id=0, max_tokens=6)
    meta = torch.device("meta")
    placed = r.place([torch.tensor([1.0, 2.0]), torch.tensor([3.0])], meta)
    assert placed.device == meta and [v.shape for v in r.split(placed)] == [(2,), (1,)]
    assert r._targets_on(meta) is r._targets_on(meta)
    assert r._targets_on(torch.device("cpu")) is r.flat_targets


def test_micro_batches_by_count_or_token_budget():
    assert micro_batches([5, 5, 5, 5, 5], 2, None) == [[0, 1], [2, 3], [4]]
    assert micro_batches([5, 5, 5, 20, 5], 99, 10) == [[0, 1], [2], [3], [4]]  # 20 > budget: alone


def test_packed_logprobs_equal_padded_ones():
    torch.manual_seed(0)
    model = build_model(0).eval()
    seqs = _seqs()
    prompts, comps = [s.prompt for s in seqs], [s.completion for s in seqs]
    with torch.no_grad():
        padded = pad_rows(prompts, comps, 0)
        lp_a, ent_a = rows_logprobs(model, padded, torch.device("cpu"), 1.0, with_entropy=True)
        packed = pack_rows(prompts, comps, 0, max_tokens=64)
        assert packed.input_ids.shape[0] < len(seqs)  # really packed
        lp_b, ent_b = rows_logprobs(model, packed, torch.device("cpu"), 1.0, with_entropy=True)
    for a, b in zip(padded.split(lp_a) + padded.split(ent_a), packed.split(lp_b) + packed.split(ent_b)):
        torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("correction", ["token_truncate", "sequence_truncate"])
def test_token_budget_gives_the_loss_and_gradient_of_sequence_micro_batches(correction):
    seqs = _seqs()
    for i, s in enumerate(seqs):
        s.staleness = i % 2  # stale rows: the correction weights matter
    ref, ref_grads, _ = _run(_cfg(micro_batch_sequences=64, entropy_coef=0.05, off_policy_correction=correction), seqs, 4)
    res, grads, _ = _run(_cfg(max_tokens_per_micro_batch=40, entropy_coef=0.05, off_policy_correction=correction),
                         seqs, 4)
    assert len(res.stats) > 2  # several micro-batches
    assert res.losses[0] == pytest.approx(ref.losses[0], rel=1e-4, abs=1e-7)
    assert ref.losses[0] != 0
    for name, g in ref_grads.items():
        torch.testing.assert_close(grads[name], g, rtol=1e-3, atol=1e-6, msg=name)


def test_sequence_weights_on_packed_segments_equal_one_row_per_sequence():
    prox = torch.tensor([[0.1, 0.2, 0.0], [0.5, 0.0, 0.0]])
    behav = torch.zeros(2, 3)
    mask = torch.tensor([[True, True, False], [True, False, False]])
    w_rows, st_rows = behaviour_weights(prox, behav, mask, "sequence_truncate", 2.0)
    packed_prox, packed_mask = torch.tensor([[0.1, 0.2, 0.5]]), torch.tensor([[True, True, True]])
    w_packed, st_packed = behaviour_weights(packed_prox, torch.zeros(1, 3), packed_mask, "sequence_truncate", 2.0,
                                            segments=torch.tensor([[0, 0, 1]]))
    assert w_packed[0].tolist() == pytest.approx([float(w_rows[0, 0]), float(w_rows[0, 1]), float(w_rows[1, 0])])
    assert float(w_rows[0, 0]) != pytest.approx(float(w_rows[1, 0]))  # two sequences, two weights
    assert {k: float(v) for k, v in st_packed.items()} == pytest.approx({k: float(v) for k, v in st_rows.items()})
