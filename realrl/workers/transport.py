"""Authenticated, typed messages over ZeroMQ: a JSON envelope plus raw tensor buffers.

Why this exists: the master and the model workers exchange batches (packed tensors) and
small control messages. Pickle would let anyone who can reach a port run code in a worker,
so the wire carries only JSON and raw bytes, and every message is signed with a per-run
secret. Nothing received is ever unpickled.

Wire format, one ZeroMQ multipart message (a ROUTER socket adds the peer identity in front):

    [mac, envelope_json, buf_0, buf_1, ...]

    mac            32 bytes: HMAC-SHA256(secret, envelope_json || buf_0 || buf_1 || ...)
    envelope_json  UTF-8 JSON {"version", "kind", "message_id", "sent_at", "header",
                               "tensors": [{"name", "dtype", "shape", "nbytes"}, ...]}
    buf_i          raw bytes of tensor i: C-contiguous, native (little-endian) byte order

Hashing the plain concatenation is unambiguous because the envelope, itself covered by the
MAC, states the byte count of every buffer and the receiver checks each frame against it.

A receiver checks, in this order, and drops (logging a rate-limited WARNING that names the
peer and the reason) any message that fails: frame count; total size against
`max_message_bytes` (before any hashing or decoding; each socket also sets zmq's
`MAXMSGSIZE`, so one oversized frame closes that connection inside libzmq); the MAC
(constant-time compare); envelope JSON; tensor specs (known dtype, non-negative shape,
`nbytes == numel * itemsize == len(frame)`); freshness (a timestamp outside
`replay_window_s` of the receiver's clock, or a message id already seen, is a replay).
The socket keeps serving after a drop.

Secrets: the launcher calls `create_run_secret(run_dir)` once; processes on the same file
system call `load_run_secret(run_dir)`. Workers on other nodes may instead receive the
secret as hex in the environment variable `REALRL_RUN_SECRET` (`run_secret_env(secret)`
builds it); when set it takes precedence over the file.

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
import hashlib
import heapq
import hmac
import json
import logging
import math
import os
import secrets
import stat
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
import zmq
import zmq.asyncio

logger = logging.getLogger(__name__)

RUN_SECRET_ENV_VAR = "REALRL_RUN_SECRET"
SECRET_FILE_NAME = ".secret"
SECRET_NUM_BYTES = 32
WIRE_VERSION = 1
DEFAULT_MAX_MESSAGE_BYTES = 2 * 1024**3
DEFAULT_REPLAY_WINDOW_S = 120.0
MAX_TENSORS_PER_MESSAGE = 4096
MAX_TENSOR_DIMS = 32
WARNING_INTERVAL_S = 10.0

_DTYPES_BY_NAME: dict[str, torch.dtype] = {
    str(dtype).removeprefix("torch."): dtype
    for dtype in (
        torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64,
        torch.float16, torch.bfloat16, torch.float32, torch.float64,
        torch.complex64, torch.complex128,
        getattr(torch, "float8_e4m3fn", None), getattr(torch, "float8_e5m2", None),
    )
    if dtype is not None
}  # fmt: skip


class TransportError(RuntimeError):
    """A socket could not be set up or a message could not be sent."""


class RemoteError(RuntimeError):
    """The peer answered a request with an "error" message."""


@dataclass
class Message:
    """One typed message: a kind, a JSON-serialisable header and named tensors.

    `message_id` and `sent_at` are filled in by the transport on receipt; the sender gets
    the id of each send as the return value of `send`.
    """

    kind: str
    header: dict[str, Any] = field(default_factory=dict)
    tensors: dict[str, torch.Tensor] = field(default_factory=dict)
    message_id: str = ""
    sent_at: float = 0.0

    def reply(
        self,
        header: dict[str, Any] | None = None,
        tensors: dict[str, torch.Tensor] | None = None,
        kind: str = "reply",
    ) -> Message:
        """A message answering this one (its header carries `reply_to`)."""
        return Message(kind, {**(header or {}), "reply_to": self.message_id}, tensors or {})

    def error_reply(self, error: str) -> Message:
        return self.reply({"error": error}, kind="error")

    def raise_if_error(self) -> Message:
        if self.kind == "error":
            raise RemoteError(str(self.header.get("error", "the peer sent an error reply")))
        return self


# ----------------------------------------------------------------------------- secrets


def create_run_secret(run_dir: str | Path) -> bytes:
    """Write 32 random bytes to `run_dir/.secret`, owner-only, and return them.

    The file appears atomically with its full content and mode 0600 (written under a
    temporary name created with O_EXCL, then hard-linked into place, which never
    overwrites): a concurrent reader sees either no file or the whole secret.
    """
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    secret = secrets.token_bytes(SECRET_NUM_BYTES)
    final_path = run_dir / SECRET_FILE_NAME
    temporary_path = run_dir / f"{SECRET_FILE_NAME}.{os.getpid()}.{secrets.token_hex(4)}"
    descriptor = os.open(temporary_path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        with os.fdopen(descriptor, "wb") as secret_file:
            secret_file.write(secret)
            secret_file.flush()
            os.fsync(secret_file.fileno())
        os.link(temporary_path, final_path)
    except FileExistsError:
        raise FileExistsError(
            f"{final_path} already exists: this run directory already has a secret. "
            "Use load_run_secret() to join the run, or use a fresh run directory."
        ) from None
    finally:
        temporary_path.unlink(missing_ok=True)
    return secret


def load_run_secret(run_dir: str | Path | None = None) -> bytes:
    """The run secret from `$REALRL_RUN_SECRET` (hex) if set, else from `run_dir/.secret`.

    The file must be owned by this user and readable by nobody else, since anyone who can
    read it can make the workers run arbitrary model calls.
    """
    from_env = os.environ.get(RUN_SECRET_ENV_VAR)
    if from_env:
        try:
            secret = bytes.fromhex(from_env.strip())
        except ValueError:
            raise ValueError(f"${RUN_SECRET_ENV_VAR} is not a hex string") from None
        if len(secret) != SECRET_NUM_BYTES:
            raise ValueError(
                f"${RUN_SECRET_ENV_VAR} holds {len(secret)} bytes; expected "
                f"{SECRET_NUM_BYTES} (64 hex digits) as written by run_secret_env()"
            )
        return secret
    if run_dir is None:
        raise ValueError(f"no run secret: ${RUN_SECRET_ENV_VAR} is unset and no run_dir given")
    path = Path(run_dir) / SECRET_FILE_NAME
    status = path.stat()
    if status.st_mode & (stat.S_IRWXG | stat.S_IRWXO) or status.st_uid != os.geteuid():
        raise PermissionError(
            f"{path} has mode {stat.filemode(status.st_mode)} and owner uid {status.st_uid}; "
            f"it must be owned by uid {os.geteuid()} and private. Fix with: chmod 600 {path}"
        )
    secret = path.read_bytes()
    if len(secret) != SECRET_NUM_BYTES:
        raise ValueError(f"{path} holds {len(secret)} bytes; expected {SECRET_NUM_BYTES}")
    return secret


def run_secret_env(secret: bytes) -> dict[str, str]:
    """Environment entries that hand `secret` to a worker on another node."""
    return {RUN_SECRET_ENV_VAR: secret.hex()}


# ------------------------------------------------------------------------------ codec


class _Rejected(Exception):
    def __init__(self, category: str, detail: str):
        super().__init__(detail)
        self.category = category


class _RateLimitedWarning:
    """At most one WARNING per (peer, reason category) per interval, with a count of the rest."""

    def __init__(self, owner: str, interval_s: float = WARNING_INTERVAL_S):
        self._owner = owner
        self._interval_s = interval_s
        self._last_logged: dict[tuple[str, str], float] = {}
        self._suppressed: dict[tuple[str, str], int] = {}

    def warn(self, peer: str, category: str, detail: str) -> None:
        key = (peer, category)
        now = time.monotonic()
        if now - self._last_logged.get(key, -math.inf) < self._interval_s:
            self._suppressed[key] = self._suppressed.get(key, 0) + 1
            return
        suppressed = self._suppressed.pop(key, 0)
        self._last_logged[key] = now
        more = f" (+{suppressed} more for the same reason)" if suppressed else ""
        logger.warning("%s dropped a message from %s: %s%s", self._owner, peer, detail, more)


def _tensor_buffer(name: str, tensor: torch.Tensor) -> tuple[dict[str, Any], np.ndarray]:
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"tensor {name!r} is a {type(tensor).__name__}, not a torch.Tensor")
    dtype_name = str(tensor.dtype).removeprefix("torch.")
    if dtype_name not in _DTYPES_BY_NAME or tensor.layout != torch.strided:
        raise TypeError(
            f"tensor {name!r} has dtype {tensor.dtype} / layout {tensor.layout}; the wire "
            f"carries dense tensors of {sorted(_DTYPES_BY_NAME)}"
        )
    cpu_tensor = tensor.detach().to("cpu").resolve_conj().resolve_neg().contiguous()
    raw = cpu_tensor.reshape(-1).view(torch.uint8).numpy()  # [nbytes], a view, no copy
    spec = {"name": name, "dtype": dtype_name, "shape": list(cpu_tensor.shape)}
    spec["nbytes"] = int(raw.nbytes)
    return spec, raw


def _parse_envelope(data: bytes) -> dict[str, Any]:
    try:
        envelope = json.loads(data)
    except (ValueError, RecursionError) as error:
        raise _Rejected("envelope", f"malformed envelope JSON ({error})") from None
    expected_types = {"version": int, "kind": str, "message_id": str, "sent_at": (int, float)}
    expected_types |= {"header": dict, "tensors": list}
    if not isinstance(envelope, dict):
        raise _Rejected("envelope", "envelope JSON is not an object")
    for key, expected_type in expected_types.items():
        value = envelope.get(key)
        if not isinstance(value, expected_type) or isinstance(value, bool):
            raise _Rejected("envelope", f"envelope field {key!r} is missing or mistyped")
    if envelope["version"] != WIRE_VERSION:
        raise _Rejected("envelope", f"wire version {envelope['version']} != {WIRE_VERSION}")
    if not 0 < len(envelope["message_id"]) <= 64 or not math.isfinite(envelope["sent_at"]):
        raise _Rejected("envelope", "bad message id or timestamp")
    return envelope


def _parse_spec(spec: Any, frame_nbytes: int) -> tuple[str, torch.dtype, tuple[int, ...]]:
    if not isinstance(spec, dict) or set(spec) != {"name", "dtype", "shape", "nbytes"}:
        raise _Rejected("spec", f"tensor spec {str(spec)[:200]} lacks name/dtype/shape/nbytes")
    name, dtype_name, shape, nbytes = spec["name"], spec["dtype"], spec["shape"], spec["nbytes"]
    if not isinstance(name, str) or dtype_name not in _DTYPES_BY_NAME:
        raise _Rejected("spec", f"tensor {str(name)[:80]!r} has unknown dtype {dtype_name!r}")
    if (
        not isinstance(shape, list)
        or len(shape) > MAX_TENSOR_DIMS
        or not all(type(size) is int and size >= 0 for size in shape)
    ):
        raise _Rejected("spec", f"tensor {name!r} has invalid shape {str(shape)[:200]}")
    dtype = _DTYPES_BY_NAME[dtype_name]
    expected_nbytes = math.prod(shape) * dtype.itemsize  # Python ints: cannot overflow
    if type(nbytes) is not int or nbytes != expected_nbytes or nbytes != frame_nbytes:
        raise _Rejected(
            "spec",
            f"tensor {name!r}: shape {str(shape)[:200]} x {dtype_name} needs "
            f"{expected_nbytes} bytes; spec says {nbytes}, frame has {frame_nbytes}",
        )
    return name, dtype, tuple(shape)


def _tensor_from_buffer(dtype: torch.dtype, shape: tuple[int, ...], buffer: Any) -> torch.Tensor:
    """Copy the frame into fresh (aligned, writable) storage, then view it as `dtype`."""
    raw = torch.empty(len(buffer), dtype=torch.uint8)  # [nbytes]
    if len(buffer):
        raw.numpy()[:] = np.frombuffer(buffer, dtype=np.uint8)
    return raw.view(dtype).reshape(shape)


class _Codec:
    """Signs outgoing messages; verifies, decodes and de-duplicates incoming ones."""

    def __init__(self, secret: bytes, max_message_bytes: int, replay_window_s: float, owner: str):
        if not isinstance(secret, bytes) or len(secret) < 16:
            raise ValueError("the run secret must be at least 16 bytes; use create_run_secret()")
        self._secret = secret
        self._max_message_bytes = max_message_bytes
        self._replay_window_s = replay_window_s
        self._seen_ids: set[str] = set()
        self._expiry_heap: list[tuple[float, str]] = []
        self.warning = _RateLimitedWarning(owner)

    def encode(self, message: Message) -> tuple[str, list[Any]]:
        if not isinstance(message.kind, str) or not message.kind:
            raise ValueError(f"message kind must be a non-empty string, got {message.kind!r}")
        specs, buffers = [], []
        for name, tensor in message.tensors.items():
            spec, buffer = _tensor_buffer(name, tensor)
            specs.append(spec)
            buffers.append(buffer)
        message_id = secrets.token_hex(16)
        envelope = {"version": WIRE_VERSION, "kind": message.kind, "message_id": message_id}
        envelope |= {"sent_at": time.time(), "header": message.header, "tensors": specs}
        try:
            envelope_json = json.dumps(envelope, separators=(",", ":")).encode()
        except (TypeError, ValueError) as error:
            raise TypeError(
                f"the header of a {message.kind!r} message is not JSON-serialisable ({error}); "
                "put tensors in Message.tensors and convert numpy scalars with float()/int()"
            ) from None
        mac = hmac.new(self._secret, envelope_json, hashlib.sha256)
        for buffer in buffers:
            mac.update(buffer)
        return message_id, [mac.digest(), envelope_json, *buffers]

    def decode(self, frames: list[zmq.Frame], peer: str) -> Message | None:
        try:
            return self._decode(frames)
        except _Rejected as rejected:
            self.warning.warn(peer, rejected.category, str(rejected))
            return None

    def _decode(self, frames: list[zmq.Frame]) -> Message:
        if not 2 <= len(frames) <= 2 + MAX_TENSORS_PER_MESSAGE:
            raise _Rejected("frames", f"wrong number of frames ({len(frames)})")
        total_nbytes = sum(len(frame) for frame in frames)
        if total_nbytes > self._max_message_bytes:
            raise _Rejected(
                "size", f"{total_nbytes} bytes exceed max_message_bytes={self._max_message_bytes}"
            )
        mac_frame, envelope_frame, *buffer_frames = frames
        mac = hmac.new(self._secret, envelope_frame.buffer, hashlib.sha256)
        for frame in buffer_frames:
            mac.update(frame.buffer)
        if not hmac.compare_digest(mac.digest(), mac_frame.bytes):
            raise _Rejected("mac", "bad MAC (wrong run secret, or the message was altered)")
        envelope = _parse_envelope(envelope_frame.bytes)
        specs = envelope["tensors"]
        if len(specs) != len(buffer_frames):
            raise _Rejected(
                "frames",
                f"wrong number of frames: {len(specs)} tensors described, "
                f"{len(buffer_frames)} buffer frames received",
            )
        parsed = [_parse_spec(spec, len(frame)) for spec, frame in zip(specs, buffer_frames)]
        if len({name for name, _, _ in parsed}) != len(parsed):
            raise _Rejected("spec", "duplicate tensor names")
        self._check_fresh(envelope["message_id"], float(envelope["sent_at"]))
        tensors = {
            name: _tensor_from_buffer(dtype, shape, frame.buffer)
            for (name, dtype, shape), frame in zip(parsed, buffer_frames)
        }
        return Message(
            envelope["kind"], envelope["header"], tensors, envelope["message_id"],
            float(envelope["sent_at"]),
        )  # fmt: skip

    def _check_fresh(self, message_id: str, sent_at: float) -> None:
        """Reject replays: a stale or far-future timestamp, or an id seen within the window.

        An id is remembered until its timestamp leaves the window; from then on the
        timestamp check alone rejects a replay, so memory stays bounded by the message rate.
        """
        now = time.time()
        while self._expiry_heap and self._expiry_heap[0][0] < now:
            self._seen_ids.discard(heapq.heappop(self._expiry_heap)[1])
        if abs(now - sent_at) > self._replay_window_s:
            raise _Rejected(
                "replay",
                f"timestamp {now - sent_at:+.1f} s old is outside replay_window_s="
                f"{self._replay_window_s} (a replay, or clocks out of sync between nodes)",
            )
        if message_id in self._seen_ids:
            raise _Rejected("replay", f"replayed message id {message_id}")
        self._seen_ids.add(message_id)
        heapq.heappush(self._expiry_heap, (sent_at + self._replay_window_s, message_id))


# ---------------------------------------------------------------------------- sockets


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
        self._socket = zmq.Context.instance().socket(zmq.DEALER)
        _configure(self._socket, max_message_bytes)
        self._socket.connect(connect_address)
        self._codec = _Codec(
            secret, max_message_bytes, replay_window_s, f"client of {connect_address}"
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
        self._socket = zmq.asyncio.Context.instance().socket(zmq.DEALER)
        _configure(self._socket, max_message_bytes)
        self._socket.connect(connect_address)
        self._codec = _Codec(
            secret, max_message_bytes, replay_window_s, f"client of {connect_address}"
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
