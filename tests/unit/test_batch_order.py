"""The order a step takes its groups in: groups that could not be trained after this step go first, and
newer ones wait while such groups are still being generated (a bounded wait), so a slower actor's work
is not dropped as too stale just because a faster actor overtook it."""

import itertools
import queue
import threading
import time

import numpy as np

from exgrpo_async.config import LearnerConfig
from exgrpo_async.rollout import RolloutGroup
from learner.dispatch import Dispatcher, WorkItem
from learner.inbox import Inbox, fill_batch


class FakeServer:  # what Inbox reads of the server: its queue of received groups
    def __init__(self):
        self.received, self.connected = queue.Queue(), 2


def dispatcher(B: int, eta: int = 1) -> Dispatcher:
    counter = itertools.count()
    return Dispatcher(lambda: next(counter), questions_per_step=B, samples=2, temperature=1.0, max_staleness=eta)


def arrive(d: Dispatcher, server: FakeServer, item, version: int) -> None:
    """What the server does with an actor's rollouts: complete the item, queue its group."""
    assert d.complete(item.work_id) is item
    server.received.put((item, RolloutGroup(item.work_id, item.question_id, np.zeros(1, np.int32), [], version,
                                         item.actor_id)))


def ready(*versions: int) -> Inbox:
    inbox = Inbox(FakeServer())
    for i, v in enumerate(versions):
        inbox.add(WorkItem(i, i, 2, "train", 1.0), RolloutGroup(i, i, np.zeros(1, np.int32), [], v, "a"))
    return inbox


def test_groups_that_cannot_wait_go_first_then_oldest_then_arrival_order():
    inbox = ready(5, 4, 5, 4)
    order = [inbox.next_train(5, 1, need=4, expiring=0)[1] for _ in range(4)]
    assert [(g.policy_version, g.work_id) for g in order] == [(4, 1), (4, 3), (5, 0), (5, 2)]
    assert inbox.next_train(5, 1, need=1, expiring=0) is None  # nothing left


def test_a_newer_group_waits_while_the_batch_has_no_room_beside_expiring_work():
    inbox = ready(5)
    assert inbox.next_train(5, 1, need=2, expiring=2) is None
    assert inbox.next_train(5, 1, need=2, expiring=1)[1].policy_version == 5
    inbox = ready(4)  # a group at lag eta is taken whatever is still out
    assert inbox.next_train(5, 1, need=1, expiring=3)[1].policy_version == 4
    inbox = ready(5, 5)  # eta=0: every group is at lag eta, taken in arrival order
    assert [inbox.next_train(5, 0, 2, 2)[1].work_id for _ in range(2)] == [0, 1]


def test_take_stale_removes_only_groups_past_eta():
    inbox = ready(3, 5, 4, 2)
    assert sorted(g.policy_version for _, g in inbox.take_stale(5, 1)) == [2, 3]
    assert [g.policy_version for _, g in inbox.train] == [5, 4]


def test_expiring_counts_training_items_out_by_the_version_their_actor_had():
    d = dispatcher(B=4, eta=1)
    old = d.take("a", 0, 3)
    d.trained(0, version=1)
    d.take("b", 1, 2)
    d.add_eval([0], n=2, temperature=1.0, min_version=0)
    d.take("c", 0, 1)  # an eval item: not training work
    assert (d.expiring(0), d.expiring(1), d.expiring(2)) == (3, 2, 0)
    d.complete(old[0].work_id)
    d.release_actor("a")
    assert d.expiring(0) == 0


def deadline(seconds: float = 5.0):
    """A `waiting` callback that fails the test instead of letting a wrong fill_batch wait forever."""
    t_end = time.monotonic() + seconds

    def waiting(taken: int) -> None:
        assert time.monotonic() < t_end, f"still waiting after {seconds} s with {taken} groups taken"
    return waiting


def two_actors(wait_for_expiring: bool, late_s: float | None, hold_s: float = 5.0):
    """The race seen in the peer benchmark, at version 5 with B=2, eta=1: actor a holds x (handed out on
    version 4), actor b has returned y (version 4) and z (the next step's, on version 5); x arrives
    `late_s` later (None: never, its actor froze). Then two groups generated on version 6 arrive and
    the next step runs. Returns (x, y, z), the step's work ids, the next step's, its drops, and the
    first step's seconds."""
    d, server = dispatcher(B=2), FakeServer()
    (x,) = d.take("a", 4, 1)
    (y,) = d.take("b", 4, 1)
    d.trained(2, version=5)
    (z,) = d.take("b", 5, 1)
    arrive(d, server, y, 4)
    arrive(d, server, z, 5)
    if late_s is not None:
        threading.Timer(late_s, arrive, (d, server, x, 4)).start()
    L = LearnerConfig(questions_per_step=2, max_staleness=1, wait_for_expiring=wait_for_expiring)
    inbox, step, after = Inbox(server), [], []
    t0 = time.monotonic()
    fill_batch(inbox, d, 5, L, hold_s, lambda it, g: step.append(it.work_id), deadline())
    seconds = time.monotonic() - t0
    time.sleep(max(0.0, (late_s or 0) - seconds) + 0.05)  # x has arrived (or never will)
    if late_s is None:
        d.reissue(x)  # the frozen actor's item expires (reissue_expired)
    d.trained(2, version=6)
    for w in d.take("c", 6, 2):
        arrive(d, server, w, 6)
    dropped = fill_batch(inbox, d, 6, L, hold_s, lambda it, g: after.append(it.work_id), deadline())
    return (x, y, z), step, after, dropped, seconds


def test_the_slower_actors_group_is_trained_not_dropped():
    (x, y, z), step, after, dropped, seconds = two_actors(True, late_s=0.3)
    assert sorted(step) == sorted([x.work_id, y.work_id]) and dropped == 0
    assert after[0] == z.work_id and len(after) == 2
    assert 0.25 < seconds < 2.0


def test_in_arrival_order_the_slower_actors_group_is_dropped():  # what wait_for_expiring=False keeps
    (x, y, z), step, after, dropped, _ = two_actors(False, late_s=0.3)
    assert step == [y.work_id, z.work_id] and dropped == 1 and x.work_id not in after


def test_a_frozen_actor_holds_the_step_back_for_at_most_hold_s():
    (x, y, z), step, after, dropped, seconds = two_actors(True, late_s=None, hold_s=0.3)
    assert step == [y.work_id, z.work_id] and dropped == 0
    assert 0.25 < seconds < 2.0
