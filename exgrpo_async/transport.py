"""Rollout and work transport over ZeroMQ (seam 2 of 5).

One ROUTER socket on the learner, one DEALER per actor, over TCP. An actor has at most one request
outstanding (hello, work, sync), so replies arrive in order; rollout groups are one-way. Backpressure is
ZeroMQ's high-water mark: when the learner falls behind, an actor's send blocks. Every size is bounded:
the learner socket refuses messages above `max_message_mb` before they are read, and the HWMs bound
the queues on both sides.

Security: with a key folder (made by ops/make-keys) both ends speak CurveZMQ: every frame is encrypted,
the actor checks the learner's public key, and the learner's ZAP handler admits only clients whose
public key is in `authorized_clients/`. Anyone else fails the handshake, so nothing they send reaches
the learner and nothing is sent to them (a refused actor gets ConnectionRefusedError). Without keys
the traffic is plain TCP (loopback only, unless the config explicitly allows otherwise; see
`transport.curve_keys_dir`).

    actor                                learner
    hello{host,pid}                 ->   welcome{actor_id, config, weight group}
    work{version}                   ->   work{items, version} | wait{seconds} | stop
    rollouts(header + 3 raw frames) ->   (no reply)
    sync{version}                   ->   sync{version, meta}   (then both join the broadcast)
    bye                             ->   (no reply)
"""

from __future__ import annotations

import stat
import time
import uuid
from pathlib import Path

import zmq
import zmq.auth
from zmq.auth.thread import ThreadAuthenticator
from zmq.utils.monitor import recv_monitor_message

from exgrpo_async.wire import decode_header

HWM = 1000  # messages queued per peer before send blocks (bounded queue)
MAX_REPLY_BYTES = 256 << 20  # an actor refuses bigger replies unread (a work reply is a few MB at most)
SERVER_PUBLIC, SERVER_SECRET = "server.key", "server.key_secret"
CLIENT_SECRET = "client.key_secret"
AUTHORIZED = "authorized_clients"


def load_keypair(path: str | Path, secret: bool) -> tuple[bytes, bytes | None]:
    """(public, secret) Z85 keys from a zmq.auth certificate file; ValueError naming the file if unusable.

    A secret key file must not be readable by group or others (like ssh's private keys)."""
    p = Path(path)
    if not p.is_file():
        raise ValueError(f"CurveZMQ key file {p} does not exist (make a key folder with ops/make-keys)")
    if secret and p.stat().st_mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise ValueError(f"CurveZMQ secret key {p} is accessible by other users: chmod 600 {p}")
    public, secret_key = zmq.auth.load_certificate(p)
    if secret and not secret_key:
        raise ValueError(f"{p} holds no secret key")
    return public, secret_key


class LearnerSocket:
    """The learner's end: receives from every actor, replies to one by its routing id.

    With `keys_dir`: CurveZMQ server with its own context, whose ZAP handler (a thread) admits only the
    public keys in `keys_dir/authorized_clients/` (read once, at start)."""

    def __init__(self, host: str, port: int, max_message_bytes: int, keys_dir: str | None = None) -> None:
        self.secure = keys_dir is not None
        self.auth: ThreadAuthenticator | None = None
        if keys_dir is None:
            self.ctx = zmq.Context.instance()
            self.sock = self.ctx.socket(zmq.ROUTER)
        else:
            public, secret = load_keypair(Path(keys_dir).expanduser() / SERVER_SECRET, secret=True)
            clients = Path(keys_dir).expanduser() / AUTHORIZED
            if not clients.is_dir() or not any(clients.glob("*.key")):
                raise ValueError(f"{clients} holds no client public keys (*.key): no actor could connect")
            self.ctx = zmq.Context()  # one ZAP handler per context: a private one per secure socket
            self.auth = ThreadAuthenticator(self.ctx)
            self.auth.start()
            self.auth.configure_curve(domain="*", location=str(clients))
            self.sock = self.ctx.socket(zmq.ROUTER)
            self.sock.curve_secretkey = secret
            self.sock.curve_publickey = public
            self.sock.curve_server = True  # the handler above is up: libzmq would admit any key without one
        self.sock.setsockopt(zmq.MAXMSGSIZE, max_message_bytes)
        self.sock.setsockopt(zmq.RCVHWM, HWM)
        self.sock.setsockopt(zmq.SNDHWM, HWM)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.ROUTER_MANDATORY, 0)  # replies to vanished actors are dropped, not raised
        try:
            if port:
                self.sock.bind(f"tcp://{host}:{port}")
            else:
                port = self.sock.bind_to_random_port(f"tcp://{host}")
        except zmq.ZMQError:
            self.close()
            raise
        self.address = f"tcp://{host}:{port}"

    def recv(self, timeout_ms: int) -> tuple[bytes, list[zmq.Frame]] | None:
        """(peer routing id, message frames) or None after `timeout_ms`. Frames are not yet decoded."""
        if not self.sock.poll(timeout_ms, zmq.POLLIN):
            return None
        frames = self.sock.recv_multipart(copy=False)
        return frames[0].bytes, frames[1:]

    def send(self, peer: bytes, frames: list) -> None:
        self.sock.send_multipart([peer, *frames], copy=False)

    def close(self) -> None:
        self.sock.close(linger=0)
        if self.auth is not None:
            self.auth.stop()
            self.ctx.term()


class ActorSocket:
    """An actor's end: requests with a deadline, and one-way sends of rollout groups.

    With `keys_dir`: CurveZMQ client using `client.key_secret` and trusting only `server.key`. A refused
    handshake (key not authorized, wrong server key, curve on one side only) raises ConnectionRefusedError
    from `send`/`request` instead of blocking forever: ZeroMQ drops the queue of a refused peer."""

    def __init__(self, address: str, keys_dir: str | None = None) -> None:
        self.address = address
        self.ctx = zmq.Context.instance()
        self.sock = self.ctx.socket(zmq.DEALER)
        if keys_dir is not None:
            keys = Path(keys_dir).expanduser()
            public, secret = load_keypair(keys / CLIENT_SECRET, secret=True)
            server_public, _ = load_keypair(keys / SERVER_PUBLIC, secret=False)
            self.sock.curve_secretkey = secret
            self.sock.curve_publickey = public
            self.sock.curve_serverkey = server_public
        self._hint = ("is this actor's client.key in the learner's authorized_clients/, and server.key the learner's?"
                      if keys_dir is not None else "if the learner has transport.curve_keys_dir, pass --keys DIR")
        self._refused: str | None = None
        # a unique inproc name: pyzmq's default names it by the socket's fd, which a new socket reuses while a
        # closed one's monitor may still hold the name ("Address already in use", seen in test_security)
        self._monitor = self.sock.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_HANDSHAKE_FAILED_AUTH
                                                     | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL,
                                                     addr=f"inproc://actor-monitor-{uuid.uuid4().hex}")
        self.sock.setsockopt(zmq.ROUTING_ID, uuid.uuid4().hex.encode())
        self.sock.setsockopt(zmq.SNDHWM, HWM)
        self.sock.setsockopt(zmq.RCVHWM, HWM)
        self.sock.setsockopt(zmq.LINGER, 2000)  # let queued rollouts drain at exit, but never hang
        self.sock.setsockopt(zmq.MAXMSGSIZE, MAX_REPLY_BYTES)  # a hostile learner cannot exhaust our memory
        self.sock.connect(address)

    def _check_refused(self) -> None:
        while self._monitor.poll(0):
            event = recv_monitor_message(self._monitor)["event"]
            self._refused = None if event == zmq.EVENT_HANDSHAKE_SUCCEEDED else (
                "key not authorized" if event == zmq.EVENT_HANDSHAKE_FAILED_AUTH else "security mismatch")
        if self._refused:
            raise ConnectionRefusedError(f"the learner at {self.address} refused the handshake "
                                         f"({self._refused}): {self._hint}")

    def _wait(self, flag: int, deadline: float | None) -> bool:
        """Poll for `flag` until `deadline` (None: forever); raises if the learner refused us meanwhile."""
        while True:
            left = 0.2 if deadline is None else min(0.2, max(0.0, deadline - time.monotonic()))
            if self.sock.poll(int(left * 1000), flag):
                return True
            self._check_refused()
            if deadline is not None and time.monotonic() >= deadline:
                return False

    def send(self, frames: list) -> None:
        """Blocks while the learner's queue for us is full (backpressure)."""
        self._wait(zmq.POLLOUT, None)
        self.sock.send_multipart(frames, copy=False)

    def request(self, frames: list, timeout_s: float) -> tuple[dict, list[zmq.Frame]]:
        """Send and wait for the reply; TimeoutError if the learner does not answer in time."""
        deadline = time.monotonic() + timeout_s
        if not self._wait(zmq.POLLOUT, deadline):
            raise TimeoutError(f"could not send to the learner within {timeout_s:.0f}s")
        self.sock.send_multipart(frames, copy=False)
        if not self._wait(zmq.POLLIN, deadline):
            raise TimeoutError(f"learner did not answer within {timeout_s:.0f}s")
        reply = self.sock.recv_multipart(copy=False)
        return decode_header(reply[0].buffer), reply[1:]

    def close(self) -> None:
        self.sock.disable_monitor()
        self._monitor.close(linger=0)
        self.sock.close()
