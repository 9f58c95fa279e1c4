"""Rollout and work transport over ZeroMQ (seam 2 of 5).

One ROUTER socket on the learner, one DEALER per actor, over TCP. An actor has at most one request
outstanding (hello, work, sync), so replies arrive in order; rollout groups are one-way. Backpressure is
ZeroMQ's high-water mark: when the learner falls behind, an actor's send blocks. Every size is bounded:
the learner socket refuses messages above `max_message_mb` before they are read, and the HWMs bound
the queues on both sides.

    actor                                learner
    hello{host,pid}                 ->   welcome{actor_id, config, weight group}
    work{version}                   ->   work{items, version} | wait{seconds} | stop
    rollouts(header + 3 raw frames) ->   (no reply)
    sync{version}                   ->   sync{version, meta}   (then both join the broadcast)
    bye                             ->   (no reply)
"""

from __future__ import annotations

import uuid

import zmq

from exgrpo_async.wire import decode_header

HWM = 1000  # messages queued per peer before send blocks (bounded queue)


class LearnerSocket:
    """The learner's end: receives from every actor, replies to one by its routing id."""

    def __init__(self, host: str, port: int, max_message_bytes: int) -> None:
        self.ctx = zmq.Context.instance()
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.MAXMSGSIZE, max_message_bytes)
        self.sock.setsockopt(zmq.RCVHWM, HWM)
        self.sock.setsockopt(zmq.SNDHWM, HWM)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.ROUTER_MANDATORY, 0)  # replies to vanished actors are dropped, not raised
        if port:
            self.sock.bind(f"tcp://{host}:{port}")
        else:
            port = self.sock.bind_to_random_port(f"tcp://{host}")
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


class ActorSocket:
    """An actor's end: requests with a deadline, and one-way sends of rollout groups."""

    def __init__(self, address: str) -> None:
        self.ctx = zmq.Context.instance()
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.ROUTING_ID, uuid.uuid4().hex.encode())
        self.sock.setsockopt(zmq.SNDHWM, HWM)
        self.sock.setsockopt(zmq.RCVHWM, HWM)
        self.sock.setsockopt(zmq.LINGER, 2000)  # let queued rollouts drain at exit, but never hang
        self.sock.connect(address)

    def send(self, frames: list) -> None:
        self.sock.send_multipart(frames, copy=False)

    def request(self, frames: list, timeout_s: float) -> tuple[dict, list[zmq.Frame]]:
        """Send and wait for the reply; TimeoutError if the learner does not answer in time."""
        self.send(frames)
        if not self.sock.poll(int(timeout_s * 1000), zmq.POLLIN):
            raise TimeoutError(f"learner did not answer within {timeout_s:.0f}s")
        reply = self.sock.recv_multipart(copy=False)
        return decode_header(reply[0].buffer), reply[1:]

    def close(self) -> None:
        self.sock.close()
