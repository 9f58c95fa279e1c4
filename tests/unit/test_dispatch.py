"""Work dispatch: admission bounds staleness, nothing dispatched is lost, eval goes first."""

import itertools

import numpy as np

from learner.dispatch import Dispatcher
from learner.maths.buffer import Trajectory


def make(B=4, eta=1):
    counter = itertools.count()
    return Dispatcher(lambda: next(counter), questions_per_step=B, samples=8, temperature=1.0, max_staleness=eta)


def test_admission_caps_training_work_at_eta_plus_one_steps():
    d = make(B=4, eta=1)
    got = d.take("a", 0, 100)
    assert len(got) == 8 and all(w.n == 8 and w.purpose == "train" for w in got)
    assert d.take("b", 0, 100) == []
    d.trained(4, version=1)
    assert len(d.take("b", 1, 100)) == 4
    d0 = make(B=4, eta=0)
    assert len(d0.take("a", 0, 100)) == 4  # eta=0: synchronous, one step of work at a time


def test_every_item_is_completed_once():
    d = make()
    items = d.take("a", 0, 3)
    assert d.complete(items[0].work_id) is items[0]
    assert d.complete(items[0].work_id) is None  # a duplicate reply is rejected
    assert d.complete(12345) is None


def test_reissued_questions_go_out_first_and_do_not_consume_budget():
    d = make(B=2, eta=0)
    a, b = d.take("a", 0, 10)
    d.complete(a.work_id)
    d.reissue(a)
    again = d.take("b", 0, 10)
    assert [w.question_id for w in again] == [a.question_id]


def test_release_actor_reissues_everything_it_held():
    d = make(B=4, eta=0)
    held = d.take("dead", 0, 3)
    assert d.release_actor("dead") == 3
    assert not d.outstanding
    taken = d.take("alive", 0, 10)
    assert [w.question_id for w in taken[:3]] == [w.question_id for w in held]


def test_eval_first_and_only_on_new_enough_weights():
    d = make(B=4, eta=0)
    d.add_eval([0, 1], n=4, temperature=1.0, min_version=2)
    assert all(w.purpose == "train" for w in d.take("a", 1, 10))
    ev = d.take("b", 2, 10)
    assert [w.purpose for w in ev] == ["eval", "eval"] and [w.question_id for w in ev] == [0, 1]


def test_stop_hands_out_nothing():
    d = make()
    d.stop()
    assert d.take("a", 0, 10) == []


def test_experience_items_go_before_fresh_ones_within_the_budget():
    d = make(B=4, eta=0)
    d.add_experience([(100, "traj-a"), (101, "traj-b")], n=7)
    got = d.take("a", 0, 10)
    assert [(w.question_id, w.n, w.replay) for w in got[:2]] == [(100, 7, "traj-a"), (101, 7, "traj-b")]
    assert len(got) == 4 and all(w.replay is None and w.n == 8 for w in got[2:])
    assert d.experience_in_flight() == {100, 101}
    assert d.release_actor("a") == 4
    again = d.take("b", 0, 10)
    assert [w.replay for w in again[:2]] == ["traj-a", "traj-b"]  # a lost experience item comes back whole


def test_expired_work_is_reissued_and_late_replies_are_rejected():
    d = make(B=4, eta=0)
    held = d.take("frozen", 0, 2)
    assert d.reissue_expired(deadline_s=3600) == []
    for w in held:
        w.dispatched_at -= 10  # as if handed out 10 s ago
    assert [w.work_id for w in d.reissue_expired(deadline_s=5)] == [w.work_id for w in held]
    again = d.take("alive", 0, 10)
    assert [w.question_id for w in again[:2]] == [w.question_id for w in held]
    assert all(d.complete(w.work_id) is None for w in held)  # the frozen actor's late rollouts: dropped


def test_seeded_items_depend_on_question_and_version_not_on_actor_or_work_id():
    import itertools

    def seeds(order, version, actor):
        d = Dispatcher(iter(order).__next__, questions_per_step=4, samples=8, temperature=1.0, max_staleness=0,
                       sampling_seed=7)
        d._ids = itertools.count(1000 if actor == "b" else 1)  # a restarted learner numbers work differently
        d.version = version
        return {it.question_id: it.seed for it in d.take(actor, version, 4)}

    a = seeds([3, 1, 2, 0], 5, "a")
    assert a == seeds([3, 1, 2, 0], 5, "b")  # another actor, other work ids: the same samples
    assert len(set(a.values())) == 4 and all(0 <= s < 2**31 for s in a.values())
    assert a[3] != seeds([3, 1, 2, 0], 6, "a")[3]  # a new version draws new samples
    unseeded = Dispatcher(iter([1]).__next__, 4, 8, 1.0, 0)
    assert unseeded.take("a", 0, 1)[0].seed is None


def replay_traj(*ids):
    return Trajectory(np.array(ids, np.int32), np.full(len(ids), -0.5, np.float32), version=3)


def test_experience_stays_open_until_trained_not_just_until_it_arrives():
    # bug 6 of the fidelity review: a group received but still in the learner's inbox was forgotten
    d = make(B=4, eta=0)
    d.add_experience([(100, replay_traj(1, 2)), (101, replay_traj(3))], n=7)
    assert d.experience_in_flight() == {100, 101}  # queued
    got = d.take("a", 0, 2)
    assert [w.question_id for w in got] == [100, 101]
    assert d.experience_in_flight() == {100, 101}  # dispatched
    assert d.complete(got[0].work_id) is got[0] and d.complete(got[1].work_id) is got[1]
    assert d.experience_in_flight() == {100, 101}  # arrived, waiting in the inbox: still open
    d.experience_done([100])
    assert d.experience_in_flight() == {101}
    d.experience_done([101, 101, 555])  # ids with nothing open are ignored; counts never go negative
    assert d.experience_in_flight() == set()
    d.add_experience([(100, replay_traj(1, 2))], n=7)
    assert d.experience_in_flight() == {100}


def test_experience_open_counts_survive_release_and_a_state_roundtrip():
    d = make(B=4, eta=1)
    d.add_experience([(100, replay_traj(1)), (101, replay_traj(2)), (102, replay_traj(3))], n=7)
    got = d.take("a", 0, 3)
    assert d.release_actor("a") == 3 and d.experience_in_flight() == {100, 101, 102}
    got = d.take("b", 0, 3)
    received = [d.complete(got[0].work_id)]  # in the inbox at checkpoint time
    d.complete(got[1].work_id)
    d.experience_done([101])  # trained
    state = d.state_dict(received)
    d2 = make(B=4, eta=1)
    d2.load_state_dict(state)
    assert d2.experience_in_flight() == {100, 102}
    assert [w.question_id for w in d2.take("c", 0, 10)[:2]] == [100, 102]
    d2.experience_done([100, 102])
    assert d2.experience_in_flight() == set()


def test_reissued_experience_item_comes_back_with_its_replay():
    # bug 5 of the fidelity review: a stale-dropped experience item came back as a plain fresh question
    d = make(B=4, eta=0)
    t = replay_traj(7, 8, 9)
    d.add_experience([(100, t)], n=7)
    (item,) = d.take("a", 0, 1)
    dispatched = d.train_dispatched
    d.add_experience([(200, replay_traj(5))], n=7)  # queued behind: the re-issued one goes first
    assert d.complete(item.work_id) is item
    d.reissue(item)
    assert d.train_dispatched == dispatched - 1
    assert d.experience_in_flight() == {100, 200}  # still open: not trained yet
    again = d.take("b", 0, 10)
    assert d.train_dispatched == dispatched - 1 + len(again)  # a round trip costs no admission budget
    first = again[0]
    assert (first.question_id, first.n, first.purpose, first.temperature) == (100, 7, "train", 1.0)
    assert first.replay is not None and first.replay.token_ids.tolist() == [7, 8, 9]
    assert first.work_id != item.work_id and first.actor_id == "b" and d.outstanding[first.work_id] is first
    assert again[1].question_id == 200 and all(w.replay is None and w.n == 8 for w in again[2:])
    assert d.complete(item.work_id) is None  # the old work id is gone


def test_reissued_fresh_item_comes_back_fresh_and_admission_is_unchanged():
    d = make(B=2, eta=0)
    a, b = d.take("a", 0, 10)
    assert d.take("a", 0, 10) == [] and d.train_dispatched == 2
    d.complete(a.work_id)
    d.reissue(a)
    assert d.train_dispatched == 1 and d.experience_in_flight() == set()
    (again,) = d.take("b", 0, 10)
    assert (again.question_id, again.n, again.replay, again.purpose) == (a.question_id, 8, None, "train")
    assert d.train_dispatched == 2 and d.take("b", 0, 10) == []
