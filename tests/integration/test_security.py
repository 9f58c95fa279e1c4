"""Transport security over real sockets: with CurveZMQ keys only authorized actors reach the learner, a
peer without keys, with an unauthorized key or facing an impostor learner gets nothing through in either
direction; sizes stay capped; sockets and the weight-sync store bind the configured address only."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
from datetime import timedelta
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed as dist
import zmq

from exgrpo_async.config_io import load_config
from exgrpo_async.rollout import Completion, RolloutGroup
from exgrpo_async.transport import ActorSocket, LearnerSocket
from exgrpo_async.weight_sync import WeightPublisher
from exgrpo_async.wire import decode_header, decode_rollouts, encode_control, encode_rollouts

ROOT = Path(__file__).resolve().parents[2]
CAP = 2 << 20


def make_keys(path: Path) -> Path:
    subprocess.run([str(ROOT / "ops" / "make-keys"), str(path)], check=True, capture_output=True,
                   env=dict(os.environ, PYTHON=sys.executable))
    return path


@pytest.fixture
def keys(tmp_path) -> Path:
    return make_keys(tmp_path / "keys")


@pytest.fixture
def rogue(tmp_path, keys) -> Path:
    """A client keypair the learner never authorized, holding the learner's true public key."""
    path = make_keys(tmp_path / "rogue")
    shutil.copy(keys / "server.key", path / "server.key")
    return path


@pytest.fixture
def learner(keys):
    sock = LearnerSocket("127.0.0.1", 0, CAP, keys_dir=str(keys))
    yield sock
    sock.close()


def drop(actor: ActorSocket) -> None:
    actor.sock.close(linger=0)


def group() -> RolloutGroup:
    comps = [Completion(np.arange(5, dtype=np.int32), np.zeros(5, np.float32), 1.0, "stop")] * 2
    return RolloutGroup(work_id=7, question_id=3, prompt_ids=np.arange(4, dtype=np.int32), completions=comps,
                        policy_version=0, actor_id="actor-1")


def answer_one(learner: LearnerSocket, actor: ActorSocket, kind: str) -> dict:
    """`actor` sends `kind`, the learner receives it and replies work; returns the actor's reply header."""
    actor.send(encode_control(kind))
    got = learner.recv(5000)
    assert got is not None, "an authorized actor's message did not reach the learner"
    peer, frames = got
    assert decode_header(frames[0].buffer)["t"] == kind
    learner.send(peer, encode_control("work", items=[], version=0))
    assert actor.sock.poll(5000), "the learner's reply did not reach the authorized actor"
    return decode_header(actor.sock.recv_multipart()[0])


def assert_shut_out(learner: LearnerSocket, intruder: ActorSocket) -> None:
    """Nothing the intruder sends reaches the learner, and nothing addressed to it reaches it."""
    for frames in (encode_control("hello", host="evil", pid=1, tp=1), encode_rollouts(group())):
        try:  # raw sends: queued while the handshake is under way, dropped by ZeroMQ once it is refused
            intruder.sock.send_multipart(frames, flags=zmq.NOBLOCK)
        except zmq.Again:
            pass
    assert learner.recv(1500) is None, "a peer without authorized keys reached the learner"
    rid = intruder.sock.getsockopt(zmq.ROUTING_ID)
    learner.send(rid, encode_control("work", items=[{"prompt": "secret"}], version=0))
    assert not intruder.sock.poll(1000), "work reached a peer without authorized keys"
    with pytest.raises(ConnectionRefusedError, match="refused the handshake"):  # told, promptly, not left hanging
        intruder.request(encode_control("work", version=0), timeout_s=30.0)


def test_authorized_actor_talks_both_ways(learner, keys):
    actor = ActorSocket(learner.address, keys_dir=str(keys))
    try:
        assert answer_one(learner, actor, "hello")["t"] == "work"
        actor.send(encode_rollouts(group()))
        got = learner.recv(5000)
        assert got is not None
        head = decode_header(got[1][0].buffer)
        g = decode_rollouts(head, got[1][1:])
        assert (g.work_id, g.question_id, len(g.completions)) == (7, 3, 2)
    finally:
        drop(actor)


def test_peer_without_keys_gets_nothing(learner, keys):
    intruder = ActorSocket(learner.address)  # plain ZeroMQ, as before this feature
    try:
        assert_shut_out(learner, intruder)
    finally:
        drop(intruder)
    actor = ActorSocket(learner.address, keys_dir=str(keys))  # control: the learner itself is fine
    try:
        assert answer_one(learner, actor, "hello")["t"] == "work"
    finally:
        drop(actor)


def test_unauthorized_client_key_gets_nothing(learner, keys, rogue):
    intruder = ActorSocket(learner.address, keys_dir=str(rogue))
    try:
        assert_shut_out(learner, intruder)
    finally:
        drop(intruder)
    actor = ActorSocket(learner.address, keys_dir=str(keys))
    try:
        assert answer_one(learner, actor, "work")["t"] == "work"
    finally:
        drop(actor)


def test_same_check_would_fail_without_keys():
    """The shut-out check is not vacuous: a learner without keys lets the keyless peer through."""
    open_learner = LearnerSocket("127.0.0.1", 0, CAP)
    peer = ActorSocket(open_learner.address)
    try:
        with pytest.raises(AssertionError, match="reached the learner"):
            assert_shut_out(open_learner, peer)
    finally:
        drop(peer)
        open_learner.close()


def test_actor_refuses_an_impostor_learner(tmp_path, keys):
    """A learner with another server key (even one that admits the actor's key) gets nothing from the actor."""
    fake = make_keys(tmp_path / "impostor")
    shutil.copy(keys / "client.key", fake / "authorized_clients" / "victim.key")
    impostor = LearnerSocket("127.0.0.1", 0, CAP, keys_dir=str(fake))
    actor = ActorSocket(impostor.address, keys_dir=str(keys))
    try:
        actor.send(encode_rollouts(group()))
        assert impostor.recv(1500) is None, "an actor talked to a learner whose key it does not trust"
    finally:
        drop(actor)
        impostor.close()


def test_oversized_message_refused_with_curve(learner, keys):
    big = ActorSocket(learner.address, keys_dir=str(keys))
    try:
        big.send(encode_control("junk", blob=b"x" * (CAP + (1 << 20))))
        got = learner.recv(1500)
        assert got is None or decode_header(got[1][0].buffer)["t"] != "junk", "a message above the cap got in"
    finally:
        drop(big)
    actor = ActorSocket(learner.address, keys_dir=str(keys))  # the learner keeps serving others
    try:
        assert answer_one(learner, actor, "hello")["t"] == "work"
    finally:
        drop(actor)


def test_bad_key_folders_are_refused(tmp_path, keys):
    with pytest.raises(ValueError, match="does not exist"):
        LearnerSocket("127.0.0.1", 0, CAP, keys_dir=str(tmp_path / "missing"))
    with pytest.raises(ValueError, match="does not exist"):
        ActorSocket("tcp://127.0.0.1:1", keys_dir=str(tmp_path / "missing"))
    os.chmod(keys / "server.key_secret", 0o644)
    with pytest.raises(ValueError, match="chmod 600"):
        LearnerSocket("127.0.0.1", 0, CAP, keys_dir=str(keys))
    os.chmod(keys / "server.key_secret", 0o600)
    for f in (keys / "authorized_clients").iterdir():
        f.unlink()
    with pytest.raises(ValueError, match="no client public keys"):
        LearnerSocket("127.0.0.1", 0, CAP, keys_dir=str(keys))


def test_make_keys_layout_and_modes(keys):
    assert (keys.stat().st_mode & 0o777) == 0o700
    for name in ("server.key", "server.key_secret", "client.key", "client.key_secret", "authorized_clients/client.key"):
        assert (keys / name).is_file(), name
    for name in ("server.key_secret", "client.key_secret"):
        assert (keys / name).stat().st_mode & 0o777 == 0o600
    assert (keys / "client.key").read_text() == (keys / "authorized_clients" / "client.key").read_text()


# ------------------------------------------------------------------ binding


def test_default_host_is_loopback():
    assert load_config(None).transport.host == "127.0.0.1"


@pytest.mark.parametrize("host", ["0.0.0.0", "10.0.0.5", "learner.example.org", "::"])
def test_non_loopback_host_needs_keys(host):
    with pytest.raises(ValueError, match="curve_keys_dir"):
        load_config(None, [f"transport.host={host!r}"])
    assert load_config(None, [f"transport.host={host!r}", "transport.curve_keys_dir=/k"]).transport.host == host
    assert load_config(None, [f"transport.host={host!r}", "transport.allow_insecure_remote=true"])


@pytest.mark.parametrize("host", ["127.0.0.1", "127.0.0.2", "localhost", "::1"])
def test_loopback_host_needs_no_keys(host):
    assert load_config(None, [f"transport.host={host!r}"]).transport.curve_keys_dir is None


def _outside_address() -> str:
    """A non-loopback IPv4 address of this machine (no packet is sent), or skip."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect(("192.0.2.123", 9))
            addr = s.getsockname()[0]
    except OSError:
        pytest.skip("this machine has no non-loopback IPv4 route")
    if addr.startswith("127.") or addr == "0.0.0.0":
        pytest.skip("this machine has no non-loopback IPv4 address")
    return addr


def _reachable(addr: str, port: int) -> bool:
    try:
        socket.create_connection((addr, port), timeout=2).close()
        return True
    except OSError:
        return False


def test_learner_socket_listens_on_loopback_only():
    addr = _outside_address()
    sock = LearnerSocket("127.0.0.1", 0, CAP)
    try:
        port = int(sock.address.rsplit(":", 1)[1])
        assert _reachable("127.0.0.1", port)
        assert not _reachable(addr, port), f"the learner socket answers on {addr}"
    finally:
        sock.close()


def test_weight_sync_store_listens_on_configured_host_only():
    addr = _outside_address()
    plain = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)  # what torch does alone
    if not _reachable(addr, plain.port):
        pytest.skip(f"{addr} is not reachable from here; the check would prove nothing")
    del plain
    pub = WeightPublisher("127.0.0.1", 0, "gloo", torch.device("cpu"), bucket_mb=1, timeout_s=5)
    assert _reachable("127.0.0.1", pub.port)
    assert not _reachable(addr, pub.port), f"the weight-sync store answers on {addr}"
    client = dist.TCPStore("127.0.0.1", pub.port, is_master=False, timeout=timedelta(seconds=5))
    client.set("k", b"v")
    assert pub.store.get("k") == b"v"
