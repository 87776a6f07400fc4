"""The wire format of realrl's messages: a signed JSON envelope plus raw tensor buffers.

The sockets that carry it are in `realrl.workers.transport`.

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

The secret itself is made and read by `realrl.workers.run_secret`.
"""

from __future__ import annotations

import hashlib
import heapq
import hmac
import json
import logging
import math
import secrets
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
import zmq

from realrl.api.errors import UserFacingError

logger = logging.getLogger(__name__)

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


class RemoteUserFacingError(RemoteError, UserFacingError):
    """The peer failed the request on a `UserFacingError`: the message, the peer's own, is
    written for the user, and the peer's traceback is in the peer's log."""


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

    def error_reply(self, error: str, user_facing: bool = False) -> Message:
        """An error answer; `user_facing` marks `error` as a message written for the user
        (from a `UserFacingError`), which the requester raises as `RemoteUserFacingError`."""
        return self.reply({"error": error, "user_facing": user_facing}, kind="error")

    def raise_if_error(self) -> Message:
        if self.kind == "error":
            error_class = RemoteUserFacingError if self.header.get("user_facing") else RemoteError
            raise error_class(str(self.header.get("error", "the peer sent an error reply")))
        return self


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
