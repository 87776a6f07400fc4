"""ZeroMQ sockets between the master and the model workers, carrying `realrl.workers.wire`
messages: a ROUTER `Server` per worker, a synchronous `Client` and an asyncio `AsyncClient`.

Conventions for callers:
- A reply carries `header["reply_to"] = request.message_id`; use `Message.reply(...)`.
  An "error" reply carries `header["error"]`; `Message.raise_if_error()` turns it into
  `RemoteError`.
- Sends are zero-copy for buffers above 64 KiB: do not modify a sent tensor in place until
  its reply has arrived. Received tensors are fresh, writable CPU tensors (one copy).
- CUDA tensors are moved to CPU by the sender. Sockets are not thread-safe: use each one
  from one thread (or one event loop for `AsyncClient`). Contexts are shared per process.
"""

from __future__ import annotations

import asyncio
import logging
import time

import zmq
import zmq.asyncio

from realrl.workers.wire import (
    DEFAULT_MAX_MESSAGE_BYTES,
    DEFAULT_REPLAY_WINDOW_S,
    Message,
    TransportError,
    _Codec,
)

logger = logging.getLogger(__name__)


def _configure(socket: zmq.Socket, max_message_bytes: int) -> None:
    socket.setsockopt(zmq.LINGER, 0)
    socket.setsockopt(zmq.MAXMSGSIZE, max_message_bytes)


def _timeout_ms(deadline: float | None) -> int | None:
    if deadline is None:
        return None
    return max(0, int((deadline - time.monotonic()) * 1000))


def _describe_peer(identity: bytes, frame: zmq.Frame) -> str:
    try:
        address = frame.get("Peer-Address")
    except (zmq.ZMQError, AttributeError):
        address = "unknown address"
    return f"peer {identity.hex()} at {address}"


def _connect_dealer(context, connect_address: str, secret: bytes, max_message_bytes: int,
                    replay_window_s: float):
    """A DEALER socket of `context` connected to `connect_address`, and its codec."""
    socket = context.socket(zmq.DEALER)
    _configure(socket, max_message_bytes)
    socket.connect(connect_address)
    codec = _Codec(secret, max_message_bytes, replay_window_s, f"client of {connect_address}")
    return socket, codec


class Server:
    """A ROUTER socket that many clients connect to; replies are addressed by peer identity."""

    def __init__(
        self,
        bind_address: str,
        secret: bytes,
        max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
        replay_window_s: float = DEFAULT_REPLAY_WINDOW_S,
    ):
        self._socket = zmq.Context.instance().socket(zmq.ROUTER)
        _configure(self._socket, max_message_bytes)
        self._socket.setsockopt(zmq.ROUTER_MANDATORY, 1)
        try:
            self._socket.bind(bind_address)
        except zmq.ZMQError as error:
            self._socket.close()
            raise TransportError(
                f"cannot bind {bind_address}: {error}; choose a free port or use "
                "'tcp://HOST:*' to let the system pick one"
            ) from None
        self.bound_address: str = self._socket.getsockopt_string(zmq.LAST_ENDPOINT)
        self._codec = _Codec(
            secret, max_message_bytes, replay_window_s, f"server {self.bound_address}"
        )

    def recv(self, timeout_s: float | None = None) -> tuple[bytes, Message] | None:
        """The next valid message and its sender, or None after `timeout_s` (None: forever)."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while self._socket.poll(_timeout_ms(deadline), zmq.POLLIN):
            frames = self._socket.recv_multipart(zmq.NOBLOCK, copy=False)
            identity = frames[0].bytes
            message = self._codec.decode(frames[1:], _describe_peer(identity, frames[0]))
            if message is not None:
                return identity, message
        return None

    def send(self, peer: bytes, message: Message) -> str:
        """Send `message` to `peer` (an identity from `recv`); returns its message id.

        Large tensors leave zero-copy after this returns: do not modify them in place.
        """
        message_id, frames = self._codec.encode(message)
        try:
            self._socket.send_multipart([peer, *frames], copy=False)
        except zmq.ZMQError as error:
            raise TransportError(
                f"cannot send a {message.kind!r} message to peer {peer.hex()} ({error}); "
                "it has probably disconnected or exited"
            ) from None
        return message_id

    def close(self) -> None:
        self._socket.close(linger=0)


class Client:
    """A DEALER socket connected to one `Server`, used synchronously."""

    def __init__(
        self,
        connect_address: str,
        secret: bytes,
        max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
        replay_window_s: float = DEFAULT_REPLAY_WINDOW_S,
    ):
        self.address = connect_address
        self._socket, self._codec = _connect_dealer(
            zmq.Context.instance(), connect_address, secret, max_message_bytes, replay_window_s
        )

    def send(self, message: Message) -> str:
        """Queue `message` for the server; returns its message id.

        Large tensors leave zero-copy after this returns: do not modify them in place
        until the reply has arrived.
        """
        message_id, frames = self._codec.encode(message)
        self._socket.send_multipart(frames, copy=False)
        return message_id

    def recv(self, timeout_s: float | None = None) -> Message | None:
        """The next valid message, or None after `timeout_s` (None: wait forever)."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while self._socket.poll(_timeout_ms(deadline), zmq.POLLIN):
            frames = self._socket.recv_multipart(zmq.NOBLOCK, copy=False)
            message = self._codec.decode(frames, f"server {self.address}")
            if message is not None:
                return message
        return None

    def request(self, message: Message, timeout_s: float | None = None) -> Message:
        """Send and wait for the reply to this message; other messages are dropped."""
        message_id = self.send(message)
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while True:
            remaining_s = None if deadline is None else max(0.0, deadline - time.monotonic())
            reply = self.recv(remaining_s)
            if reply is None:
                raise TimeoutError(_no_reply_text(self.address, message.kind, timeout_s))
            if reply.header.get("reply_to") == message_id:
                return reply
            logger.warning(
                "client of %s dropped an unexpected %r message", self.address, reply.kind
            )

    def close(self) -> None:
        self._socket.close(linger=0)


def _no_reply_text(address: str, kind: str, timeout_s: float | None) -> str:
    return (
        f"no reply from {address} to a {kind!r} message within {timeout_s} s; "
        "check that the worker is alive (its log file) and that both sides share the run secret"
    )


class AsyncClient:
    """A DEALER socket for asyncio: many requests in flight, replies matched by `reply_to`.

    The master keeps one AsyncClient per worker and awaits several `request`s at once
    (e.g. with `asyncio.gather`). A background task reads replies and resolves the future
    of the request each answers; replies to unknown or timed-out requests are dropped.
    """

    def __init__(
        self,
        connect_address: str,
        secret: bytes,
        max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
        replay_window_s: float = DEFAULT_REPLAY_WINDOW_S,
    ):
        self.address = connect_address
        self._socket, self._codec = _connect_dealer(
            zmq.asyncio.Context.instance(),
            connect_address,
            secret,
            max_message_bytes,
            replay_window_s,
        )
        self._pending: dict[str, asyncio.Future[Message]] = {}
        self._receiver: asyncio.Task[None] | None = None

    async def request(self, message: Message, timeout_s: float | None = None) -> Message:
        """Send `message` and return the reply whose `reply_to` is its id."""
        if self._receiver is None or self._receiver.done():
            self._receiver = asyncio.get_running_loop().create_task(self._receive_replies())
        message_id, frames = self._codec.encode(message)
        reply_future: asyncio.Future[Message] = asyncio.get_running_loop().create_future()
        self._pending[message_id] = reply_future
        try:
            await self._socket.send_multipart(frames, copy=False)
            return await asyncio.wait_for(reply_future, timeout_s)
        except asyncio.TimeoutError:
            raise TimeoutError(_no_reply_text(self.address, message.kind, timeout_s)) from None
        finally:
            self._pending.pop(message_id, None)

    async def _receive_replies(self) -> None:
        try:
            while True:
                frames = await self._socket.recv_multipart(copy=False)
                reply = self._codec.decode(frames, f"server {self.address}")
                if reply is None:
                    continue
                reply_future = self._pending.get(str(reply.header.get("reply_to")))
                if reply_future is None or reply_future.done():
                    self._codec.warning.warn(
                        f"server {self.address}", "unmatched",
                        f"a {reply.kind!r} message answers no pending request (timed out?)",
                    )  # fmt: skip
                    continue
                reply_future.set_result(reply)
        except Exception as error:  # the socket failed: fail every waiter rather than hang
            for reply_future in self._pending.values():
                if not reply_future.done():
                    reply_future.set_exception(TransportError(f"{self.address}: {error}"))
            raise

    def close(self) -> None:
        if self._receiver is not None:
            self._receiver.cancel()
        self._socket.close(linger=0)
