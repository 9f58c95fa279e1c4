"""When a vLLM worker receives the learner's weights (actors/vllm_worker.py): a tensor-parallel engine
on NCCL receives only while generation is paused (a second communicator beside the TP all-reduce can
deadlock); any other engine receives in the background while it generates. The receive and the load
are stand-ins here (they need an engine); the scheduling between them is the code under test."""

from __future__ import annotations

import threading

import pytest
import torch

from actors.vllm_worker import WeightSyncExtension, serial_receive
from exgrpo_async.weight_sync import WeightReceiver


class Worker(WeightSyncExtension):
    def __init__(self, serial: bool):
        self._serial, self._reload_mode = serial, "layerwise"
        self.events: list[tuple[str, str]] = []
        self.release = threading.Event()

    def _receive(self, meta, lazy):
        self.events.append(("receive", threading.current_thread().name))
        assert self.release.wait(5)
        return ["buckets of " + meta]

    def _apply(self, received):
        self.events.append(("apply", received[0]))

    def _after_load(self, fingerprint, corrupt):
        return {}


def test_only_tensor_parallel_engines_on_nccl_receive_serially():
    assert serial_receive("nccl", 3) and serial_receive("nccl", 5)
    assert not serial_receive("nccl", 2) and not serial_receive("gloo", 3)


def test_a_serial_engine_receives_in_commit_not_while_generating():
    w = Worker(serial=True)
    w.ws_prefetch("v2")
    assert w.events == [] and w.ws_prefetch_done()  # nothing received while the engine generates
    w.release.set()
    w.ws_commit()
    assert w.events == [("receive", threading.current_thread().name), ("apply", "buckets of v2")]


def test_other_engines_receive_in_the_background_while_generating():
    w = Worker(serial=False)
    w.ws_prefetch("v2")
    assert not w.ws_prefetch_done()  # still receiving, in its own thread
    w.release.set()
    w.ws_commit()
    assert w.events == [("receive", "ws-prefetch"), ("apply", "buckets of v2")]


def test_host_copies_are_kept_per_bucket_and_reused():
    r = WeightReceiver.__new__(WeightReceiver)  # no group: only the host staging is exercised
    r._host = {}
    a = r._to_host(0, torch.arange(6.0))
    b = r._to_host(0, torch.full((6,), 7.0))
    assert a.data_ptr() == b.data_ptr() and torch.all(b == 7.0)
    assert r._to_host(1, torch.zeros(3, dtype=torch.bfloat16)).dtype == torch.bfloat16


@pytest.mark.gpu
def test_host_copies_of_gpu_buckets_are_page_locked():
    r = WeightReceiver.__new__(WeightReceiver)
    r._host = {}
    host = r._to_host(0, torch.arange(4.0, device="cuda"))
    assert host.device.type == "cpu" and host.is_pinned() and host.tolist() == [0.0, 1.0, 2.0, 3.0]
