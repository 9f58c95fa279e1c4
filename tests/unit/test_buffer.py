"""ExGRPO experience buffer rules (docs/exgrpo.md)."""

import math

import numpy as np
import pytest

from learner.maths.buffer import ExperienceBuffer, Trajectory, bucket_weights


def traj(*ids, version=0):
    return Trajectory(np.array(ids, np.int32), np.full(len(ids), -0.5, np.float32), version)


def test_bucket_moves_with_latest_k_and_k0_keeps_it():
    b = ExperienceBuffer(K=8)
    b.record(1, 3, [traj(1, 2)])
    assert b.bucket_of(1) == 3
    b.record(1, 6, [traj(1, 3)])
    assert b.bucket_of(1) == 6 and len(b.trajectories(1)) == 2
    b.record(1, 0, [])
    assert b.bucket_of(1) == 6 and len(b.trajectories(1)) == 2  # a k=0 re-roll changes nothing
    assert b.bucket_sizes() == {1: 0, 2: 0, 3: 0, 4: 0, 5: 0, 6: 1, 7: 0}
    b.record(2, 0, [traj(9)])
    assert b.bucket_of(2) is None and b.num_questions == 1


def test_duplicates_by_token_ids_are_stored_once():
    b = ExperienceBuffer(K=4)
    b.record(5, 2, [traj(1, 2, 3), traj(1, 2, 3), traj(1, 2)])
    b.record(5, 1, [traj(1, 2, 3)])
    assert [t.token_ids.tolist() for t in b.trajectories(5)] == [[1, 2, 3], [1, 2]]
    assert b.num_trajectories == 2 and b.num_tokens == 5


def test_retirement_is_permanent_and_applied_at_end_of_step():
    b = ExperienceBuffer(K=4)
    b.record(1, 2, [traj(1)])
    b.record(2, 2, [traj(2)])
    b.record(1, 4, [])  # all K correct: retired
    assert 1 not in b.sample_questions(10)  # excluded from sampling at once
    assert b.trajectories(1)  # still stored until the step ends
    b.end_step()
    assert b.trajectories(1) == [] and b.num_questions == 1
    b.record(1, 2, [traj(7)])  # never un-retired
    assert b.bucket_of(1) is None and b.sample_questions(10) == [2]


def test_sampling_is_without_replacement_and_capped():
    b = ExperienceBuffer(K=8, seed=1)
    for q in range(20):
        b.record(q, 1 + q % 7, [traj(q)])
    for _ in range(50):
        s = b.sample_questions(12)
        assert len(s) == len(set(s)) == 12
    assert sorted(b.sample_questions(100)) == list(range(20))  # more asked than stored: everything once


def test_bucket_frequencies_follow_the_gaussian_weights():
    K, n_per_bucket = 8, 200
    b = ExperienceBuffer(K=K, seed=3)
    for k in range(1, K):
        for i in range(n_per_bucket):
            b.record(k * 1000 + i, k, [traj(k, i)])
    draws = 4000
    counts = {k: 0 for k in range(1, K)}
    for _ in range(draws):
        (q,) = b.sample_questions(1)
        counts[b.bucket_of(q)] += 1
    w = bucket_weights(K)
    total = sum(w.values())
    for k in range(1, K):
        p = w[k] / total
        sd = math.sqrt(draws * p * (1 - p))
        assert abs(counts[k] - draws * p) < 5 * sd + 2, (k, counts[k], draws * p)
    assert counts[4] > counts[3] > counts[2] > counts[1]  # medium questions replayed most


def seven_buckets(n_per_bucket=100, seed=0, K=8):
    b = ExperienceBuffer(K=K, seed=seed)
    for k in range(1, K):
        for i in range(n_per_bucket):
            b.record(k * 1000 + i, k, [traj(k, i)])
    return b


def test_excluded_questions_leave_the_pools_and_the_draw_stays_gaussian():
    # bug 3 of the fidelity review: 32 experience questions in flight, mostly medium ones; asking for
    # more and truncating cut the high-k buckets off. Excluding them first keeps the Gaussian shares.
    K = 8
    b = seven_buckets(seed=5, K=K)
    per_bucket = {1: 1, 2: 3, 3: 8, 4: 10, 5: 7, 6: 2, 7: 1}
    excluded = {k * 1000 + i for k, m in per_bucket.items() for i in range(m)}
    assert len(excluded) == 32
    draws, n = 2000, 32
    counts = {k: 0 for k in range(1, K)}
    for _ in range(draws):
        s = b.sample_questions(n, exclude=excluded)
        assert len(s) == len(set(s)) == n
        assert not excluded.intersection(s)
        for q in s:
            counts[b.bucket_of(q)] += 1
    w = bucket_weights(K)
    total = sum(w.values())  # every bucket keeps questions, so all seven share the normalisation
    for k in range(1, K):
        assert abs(counts[k] / (draws * n) - w[k] / total) < 0.03, (k, counts)
    assert b.bucket_sizes() == {k: 100 for k in range(1, K)}  # the pools themselves are untouched


def test_exclusion_renormalises_over_remaining_buckets_and_caps_at_reduced_sizes():
    b = ExperienceBuffer(K=8, seed=2)
    for q in range(3):
        b.record(q, 4, [traj(q)])  # the heavy bucket: all of it excluded
    for q in range(10, 14):
        b.record(q, 1, [traj(q)])  # a light bucket: two of four excluded
    for q in range(20, 23):
        b.record(q, 6, [traj(q)])
    ex = [0, 1, 2, 10, 11, 999, 12345]  # ids outside the buffer are ignored
    for _ in range(50):
        s = b.sample_questions(3, exclude=ex)
        assert len(s) == 3 and not set(ex) & set(s)
    assert sorted(b.sample_questions(100, exclude=ex)) == [12, 13, 20, 21, 22]  # capped at what is left
    assert b.sample_questions(5, exclude=[0, 1, 2, 10, 11, 12, 13, 20, 21, 22]) == []
    assert sorted(b.sample_questions(100, weighting="uniform", exclude=set(ex))) == [12, 13, 20, 21, 22]
    for _ in range(50):
        s = b.sample_questions(2, weighting="uniform", exclude=ex)
        assert len(s) == len(set(s)) == 2 and not set(ex) & set(s)


def test_uniform_sampling_honours_exclude_and_stays_uniform():
    b = seven_buckets(n_per_bucket=10, seed=4)
    ex = {4000 + i for i in range(10)} | {3000 + i for i in range(5)}  # bucket 4 gone, bucket 3 halved
    seen = {}
    for _ in range(3000):
        for q in b.sample_questions(5, weighting="uniform", exclude=ex):
            seen[q] = seen.get(q, 0) + 1
    assert not ex & set(seen) and len(seen) == 70 - 15
    assert max(seen.values()) < 1.5 * min(seen.values())  # 3000*5/55 = 273 picks each on average


def test_picks_come_back_in_random_order_not_by_bucket():
    # sorted-by-bucket output lets any caller that truncates it bias the draw toward low k
    b = seven_buckets(n_per_bucket=20, seed=6)
    firsts_not_lowest = unsorted = 0
    for _ in range(200):
        ks = [b.bucket_of(q) for q in b.sample_questions(8)]
        firsts_not_lowest += ks[0] != min(ks)
        unsorted += ks != sorted(ks)
    assert firsts_not_lowest > 50 and unsorted > 100
    ks = [b.bucket_of(q) for q in b.sample_questions(8, weighting="uniform")]
    assert len(ks) == 8


def test_code_and_paper_gaussians_differ_as_documented():
    code = bucket_weights(8)
    z = sum(code.values())
    assert round(code[4] / z, 3) == 0.399 and round(code[1] / z, 4) == 0.0044
    paper = bucket_weights(8, units="accuracy")
    zp = sum(paper.values())
    assert 0.13 < min(paper.values()) / zp < max(paper.values()) / zp < 0.15  # almost uniform


def test_leftovers_go_to_buckets_with_room():
    b = ExperienceBuffer(K=8, seed=0)
    b.record(1, 4, [traj(1)])  # the heavy bucket has one question
    for q in range(10, 20):
        b.record(q, 1, [traj(q)])  # the light bucket has ten
    s = b.sample_questions(5)
    assert 1 in s and len(s) == 5


def test_uniform_question_sampling_ablation():
    b = ExperienceBuffer(K=8, seed=0)
    for q in range(70):
        b.record(q, 1 + q % 7, [traj(q)])
    seen = {b.bucket_of(q) for _ in range(200) for q in b.sample_questions(1, weighting="uniform")}
    assert seen == set(range(1, 8))


def test_fifo_eviction_under_a_cap():
    b = ExperienceBuffer(K=8, max_trajectories=3)
    b.record(1, 3, [traj(1), traj(2)])
    b.record(2, 3, [traj(3)])
    b.record(3, 3, [traj(4)])
    assert b.num_trajectories == 3 and b.evicted == 1
    assert [t.token_ids.tolist() for t in b.trajectories(1)] == [[2]]
    b.record(4, 3, [traj(5)])
    assert b.bucket_of(1) is None and b.trajectories(1) == []  # lost its last one: out of its bucket


def test_state_dict_roundtrip():
    b = ExperienceBuffer(K=8, seed=0)
    for q in range(30):
        b.record(q, 1 + q % 7, [traj(q, 1), traj(q, 2)])
    b.record(3, 8, [])
    b.end_step()
    c = ExperienceBuffer(K=8)
    c.load_state_dict(b.state_dict())
    assert c.retired == b.retired and c.bucket_sizes() == b.bucket_sizes() and c.num_tokens == b.num_tokens
    assert c.sample_questions(10) == b.sample_questions(10)


def test_bad_k_rejected():
    with pytest.raises(ValueError):
        ExperienceBuffer(K=8).record(1, 9, [])


def test_the_documented_example_runs():
    import doctest

    import learner.maths.buffer

    result = doctest.testmod(learner.maths.buffer)
    assert result.attempted >= 5 and result.failed == 0


def test_per_question_gaussian_shares_grow_with_bucket_size():
    import math

    buf = ExperienceBuffer(K=8, seed=3)
    sizes = {1: 200, 2: 100, 3: 4, 4: 4, 5: 4, 6: 100, 7: 200}
    q = 0
    for k, n in sizes.items():
        for _ in range(n):
            buf.record(q, k, [Trajectory(np.array([q, 2], np.int32), np.array([-0.1, -0.1], np.float32), 0)])
            q += 1
    w = {k: math.exp(-0.5 * (k - 4) ** 2) * n for k, n in sizes.items()}
    expect = {k: v / sum(w.values()) for k, v in w.items()}
    got = {k: 0 for k in sizes}
    draws = 1500
    for _ in range(draws):
        picks = buf.sample_questions(4, "gaussian_per_question")
        assert len(set(picks)) == 4
        for p in picks:
            got[buf.bucket_of(p)] += 1
    for k in sizes:  # small draws barely deplete the pools: shares follow size x weight
        assert abs(got[k] / (4 * draws) - expect[k]) < 0.03, (k, got[k] / (4 * draws), expect[k])
    # the bucket sampler would give the 12 medium questions about 88% of the draws
    assert sum(got[k] for k in (3, 4, 5)) / (4 * draws) < 0.35
