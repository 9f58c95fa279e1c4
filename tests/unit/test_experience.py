"""ExGRPO's step-end rules: retire, collect, switch, re-inject, choose (never a question with an open
experience group), and the replay-health figures."""

import random

import numpy as np

from exgrpo_async.config_io import load_config
from exgrpo_async.data import QuestionSampler
from exgrpo_async.rollout import Completion, RolloutGroup
from learner.dispatch import Dispatcher, WorkItem
from learner.maths.batch import assemble
from learner.maths.buffer import Trajectory
from learner.maths.experience import Experience

K, B = 4, 8


def _group(qid: int, rewards: list[int], version: int = 0) -> RolloutGroup:
    comps = [Completion(np.array([5 + j, 2], np.int32), np.array([-0.1, -0.2], np.float32), float(r), "stop", "ok")
             for j, r in enumerate(rewards)]
    return RolloutGroup(work_id=qid, question_id=qid, prompt_ids=np.array([1, 7], np.int32), completions=comps,
                        policy_version=version, actor_id="a", extra={"replay_reward": 1.0})


def _setup(*overrides: str):
    cfg = load_config(None, ["exgrpo.enabled=true", "exgrpo.delayed_start=false", "exgrpo.selection=random",
                             "exgrpo.pi_past=behaviour", *overrides])
    sampler = QuestionSampler(range(100), seed=0)
    disp = Dispatcher(sampler.next, B, K, 1.0, 1, sampler.exclude, include_questions=sampler.include)
    return cfg, sampler, disp, Experience(cfg.exgrpo, K, B, seed=0)


def _end(ex: Experience, disp: Dispatcher, groups, version=1, step=1):
    batch = assemble(groups, version, collecting=ex.mixed)
    return ex.end_step(step, batch, {}, version, disp, None, random.Random(0))


def test_partly_solved_groups_are_collected_solved_ones_retired_and_replays_chosen():
    cfg, _, disp, ex = _setup()
    groups = [(WorkItem(q, q, K, "train", 1.0), _group(q, [1, 0, 0, 0] if q % 2 else [1, 1, 1, 1])) for q in range(8)]
    row = _end(ex, disp, groups)
    assert ex.buffer.num_questions == 4 and ex.buffer.retired == {0, 2, 4, 6}
    assert row["buckets"][1] == 4
    assert row["experience_fresh_reward_mean"] is None and row["new_question_reward_mean"] == 0.625
    # rho * B = 4 experience questions were chosen and queued, each with K-1 fresh samples
    assert disp.experience_queued() == 4 and disp.experience_in_flight() == {1, 3, 5, 7}
    items = disp.take("a", 0, 8)
    assert all(it.n == K - 1 and it.replay is not None for it in items[:4])


def test_open_experience_is_never_chosen_again_and_queued_items_count_against_rho():
    cfg, _, disp, ex = _setup()
    groups = [(WorkItem(q, q, K, "train", 1.0), _group(q, [1, 0, 0, 0])) for q in range(8)]
    _end(ex, disp, groups)
    first = disp.experience_in_flight()
    assert len(first) == 4
    taken = [it for it in disp.take("a", 0, 8) if it.replay is not None]
    for it in taken:
        disp.complete(it.work_id)  # arrived, not yet trained: still open
    plan_before = set(first)
    ex._choose(disp, None, random.Random(1))
    second = disp.experience_in_flight() - plan_before
    assert second and not (second & plan_before) and len(disp.experience_in_flight()) == 8


def test_replay_health_counts_replays_and_ages():
    cfg, _, disp, ex = _setup()
    traj = Trajectory(np.array([5, 2], np.int32), np.array([-0.5, -0.1], np.float32), version=2)
    groups = [(WorkItem(q, q, K - 1, "train", 1.0, replay=traj), _group(q, [0, 0, 1], version=5)) for q in (1, 1, 2)]
    for q in (1, 1, 2):
        disp.add_experience([(q, traj)], n=K - 1)
    for it in disp.take("a", 5, 3):
        disp.complete(it.work_id)
    assert disp.experience_in_flight() == {1, 2}  # received, not yet trained
    row = _end(ex, disp, groups, version=6)
    assert row["replays_total"] == 3 and row["replay_count_max"] == 2 and row["replayed_questions_total"] == 2
    assert row["replay_top10_share"] == 1.0 and row["replay_age_mean"] == 4 and row["replay_reward_mean"] == 1.0
    # the three trained groups were closed: all that is open now is what this step chose and queued
    assert disp.experience_queued() == len(disp.experience_in_flight()) == 2
    assert row["experience_questions"] == 3
    assert row["experience_fresh_reward_mean"] == 1 / 3 and row["new_question_reward_mean"] is None


def test_reinjection_puts_a_share_of_retired_questions_back():
    cfg, sampler, disp, ex = _setup("exgrpo.reinject_every=2", "exgrpo.reinject_frac=0.25")
    groups = [(WorkItem(q, q, K, "train", 1.0), _group(q, [1, 1, 1, 1])) for q in range(8)]
    _end(ex, disp, groups, step=1)
    assert len(ex.buffer.retired) == 8 and ex.reinjected == 0
    _end(ex, disp, [(WorkItem(9, 9, K, "train", 1.0), _group(9, [0, 0, 0, 0]))], step=2)
    assert len(ex.buffer.retired) == 6 and ex.reinjected == 2
    back = set(range(8)) - ex.buffer.retired
    # back in the fresh pool: the next epoch draws them again
    for _ in range(100):
        sampler.next()
    assert back <= {sampler.next() for _ in range(100)}


def test_switch_is_tracked_with_exgrpo_off_for_the_clip_schedule():
    cfg = load_config(None, ["exgrpo.enabled=false"])
    sampler = QuestionSampler(range(10), seed=0)
    disp = Dispatcher(sampler.next, B, K, 1.0, 1)
    ex = Experience(cfg.exgrpo, K, B, seed=0)
    assert not ex.started
    row = _end(ex, disp, [(WorkItem(1, 1, K, "train", 1.0), _group(1, [1, 1, 0, 0]))])
    assert row == {} and ex.started and not ex.mixed and ex.buffer.num_questions == 0


def test_delayed_start_fires_at_the_first_step_whose_pass_rate_exceeds_the_threshold():
    """pass@1 below or equal to the threshold does not switch; the first step above it does (its row already
    says mixed, its batch was not collected), and the switch stays on when pass@1 falls again."""
    cfg, _, disp, ex = _setup("exgrpo.delayed_start=true", "exgrpo.start_threshold=0.5")
    trace = []
    for step, rewards in enumerate([[1, 0, 0, 0], [1, 1, 0, 0], [1, 1, 1, 0], [0, 0, 0, 0], [1, 0, 0, 0]], start=1):
        row = _end(ex, disp, [(WorkItem(step, step, K, "train", 1.0), _group(step, rewards))], step=step)
        trace.append((row["exgrpo_mixed"], row["exgrpo_collecting"], ex.buffer.num_questions))
    assert trace == [(False, False, 0), (False, False, 0), (True, False, 0), (True, True, 0), (True, True, 1)]


def test_an_experience_group_correct_only_by_its_replay_moves_its_question_to_bucket_1():
    """The authors count the replay in k (fidelity-2.md 2.1): the policy now fails the question K-1 of
    K-1 times, so it leaves its medium bucket for bucket 1, with nothing new stored."""
    cfg, _, disp, ex = _setup()
    _end(ex, disp, [(WorkItem(3, 3, K, "train", 1.0), _group(3, [1, 1, 1, 0]))])  # fresh 3/4: bucket 3
    assert ex.buffer.bucket_of(3) == 3 and ex.buffer.num_trajectories == 3
    traj = ex.buffer.trajectories(3)[0]
    row = _end(ex, disp, [(WorkItem(3, 3, K - 1, "train", 1.0, replay=traj), _group(3, [0, 0, 0]))], step=2)
    assert ex.buffer.bucket_of(3) == 1 and ex.buffer.num_trajectories == 3
    assert row["replay_only_correct_total"] == 1


def test_each_experience_question_queued_discards_the_fresh_draw_it_displaces():
    """The authors' collate replaces fresh draws by experience and drops them: with rho * B = 4
    experience questions queued, the sampler has moved 4 draws on, so the next fresh question is the
    one after them; `exgrpo.discard_displaced=false` (the ablation) keeps them for later."""
    for discard in (True, False):
        cfg, sampler, _, ex = _setup(f"exgrpo.discard_displaced={str(discard).lower()}")
        order = QuestionSampler(range(100), seed=0)
        expected = [order.next() for _ in range(8 + 4 + 1)]
        disp = Dispatcher(sampler.next, B, K, 1.0, 1, sampler.exclude, include_questions=sampler.include,
                          discard_displaced=cfg.exgrpo.discard_displaced)
        fresh = [it.question_id for it in disp.take("a", 0, B)]
        assert fresh == expected[:8]
        groups = [(WorkItem(q, q, K, "train", 1.0), _group(q, [1, 0, 0, 0])) for q in fresh]
        row = _end(ex, disp, groups)
        assert disp.experience_queued() == 4 and row["displaced_discarded_total"] == (4 if discard else 0)
        disp.trained(B, 1)
        items = disp.take("a", 1, B + 1)
        assert [it.replay is not None for it in items] == [True] * 4 + [False] * 5
        assert items[4].question_id == expected[12 if discard else 8]
        # the count survives a checkpoint
        state = disp.state_dict(sampler=sampler)
        again = Dispatcher(sampler.next, B, K, 1.0, 1, discard_displaced=discard)
        again.load_state_dict(state)
        assert again.displaced_discarded == row["displaced_discarded_total"]
