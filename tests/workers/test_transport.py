"""Real ZeroMQ sockets on 127.0.0.1: round trips, hostile peers, async matching, secrets."""

import asyncio
import hashlib
import hmac
import json
import logging
import os
import pickle
import stat
import threading
import time
from pathlib import Path

import pytest
import torch
import zmq

from realrl.api import environment
from realrl.api.errors import UserFacingError
from realrl.workers.run_secret import create_run_secret, load_run_secret, run_secret_env
from realrl.workers.transport import AsyncClient, Client, Server
from realrl.workers.wire import Message, RemoteError, RemoteUserFacingError

logger = logging.getLogger(__name__)

SECRET = bytes(range(32))
ECHO_TIMEOUT_S = 20.0


class EchoWorker:
    """A serving worker in a thread: answers every valid message with its header and tensors."""

    def __init__(self, max_message_bytes: int = 64 * 1024**2, reply_in_batches_of: int = 1):
        self.server = Server("tcp://127.0.0.1:*", SECRET, max_message_bytes=max_message_bytes)
        self.address = self.server.bound_address
        self._batch_size = reply_in_batches_of
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        waiting: list[tuple[bytes, Message]] = []
        while not self._stop.is_set():
            received = self.server.recv(timeout_s=0.05)
            if received is None:
                continue
            waiting.append(received)
            if len(waiting) < self._batch_size:
                continue
            for peer, request in reversed(waiting):  # out of order on purpose
                if request.kind == "fail":
                    self.server.send(peer, request.error_reply("asked to fail"))
                else:
                    self.server.send(peer, request.reply(request.header, request.tensors))
            waiting.clear()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        self.server.close()


@pytest.fixture
def echo_worker():
    worker = EchoWorker()
    yield worker
    worker.stop()


def _sign(secret: bytes, envelope: bytes, *buffers: bytes) -> list[bytes]:
    """Frames signed exactly as the documented wire format says, built by hand."""
    mac = hmac.new(secret, envelope, hashlib.sha256)
    for buffer in buffers:
        mac.update(buffer)
    return [mac.digest(), envelope, *buffers]


def _envelope(tensors: list[dict], sent_at: float | None = None, message_id: str = "") -> bytes:
    envelope = {
        "version": 1,
        "kind": "request",
        "message_id": message_id or os.urandom(16).hex(),
        "sent_at": time.time() if sent_at is None else sent_at,
        "header": {},
        "tensors": tensors,
    }
    return json.dumps(envelope).encode()


def _connected_dealer(address: str) -> zmq.Socket:
    socket = zmq.Context.instance().socket(zmq.DEALER)
    socket.setsockopt(zmq.LINGER, 0)
    socket.connect(address)
    return socket


def test_round_trip_preserves_every_dtype_shape_and_value(echo_worker):
    tensors = {
        "bf16": torch.tensor([1.5, -2.25, 3e38, 1e-30], dtype=torch.bfloat16),
        "f16": torch.tensor([[0.5, -1.0], [65504.0, 0.0]], dtype=torch.float16),
        "f32_special": torch.tensor([float("nan"), float("inf"), -0.0, 1.0]),
        "f64": torch.randn(3, 4, 5, dtype=torch.float64),
        "i64_extremes": torch.tensor([-(2**63), 2**63 - 1, 0]),
        "i32": torch.arange(-5, 5, dtype=torch.int32),
        "i16": torch.tensor([-32768, 32767], dtype=torch.int16),
        "i8": torch.tensor([-128, 127], dtype=torch.int8),
        "u8": torch.tensor([0, 255], dtype=torch.uint8),
        "bool": torch.tensor([True, False, True]),
        "complex": torch.tensor([1 + 2j, -3j], dtype=torch.complex64),
        "scalar_0d": torch.tensor(7.25),
        "empty": torch.empty(0, dtype=torch.float32),
        "empty_2d": torch.empty(0, 3, dtype=torch.int64),
        "non_contiguous": torch.arange(12.0).reshape(3, 4).t(),
        "requires_grad": torch.ones(2, requires_grad=True),
    }
    client = Client(echo_worker.address, SECRET)
    header = {"step": 3, "names": ["a", "b"], "nested": {"x": 1.5, "none": None}}
    reply = client.request(Message("request", header, tensors), timeout_s=ECHO_TIMEOUT_S)
    client.close()

    assert reply.kind == "reply"
    assert {key: reply.header[key] for key in header} == header
    assert set(reply.tensors) == set(tensors)
    for name, sent in tensors.items():
        received = reply.tensors[name]
        assert received.dtype == sent.dtype, name
        assert received.shape == sent.shape, name
        sent_bytes = sent.detach().contiguous().reshape(-1).view(torch.uint8)
        assert torch.equal(received.reshape(-1).view(torch.uint8), sent_bytes), name
    reply.tensors["f64"].add_(1.0)  # received tensors are ordinary writable tensors


def test_large_tensor_round_trip_is_exact(echo_worker):
    packed_values = torch.randn(50 * 1024**2 // 4)  # [12.5M] float32, 50 MiB
    client = Client(echo_worker.address, SECRET)
    start = time.perf_counter()
    reply = client.request(Message("request", tensors={"packed_values": packed_values}), 60)
    elapsed_s = time.perf_counter() - start
    client.close()
    assert torch.equal(reply.tensors["packed_values"], packed_values)
    logger.info("50 MiB round trip in %.3f s: %.0f MiB/s each way", elapsed_s, 2 * 50 / elapsed_s)


def test_error_replies_raise_remote_error(echo_worker):
    client = Client(echo_worker.address, SECRET)
    reply = client.request(Message("fail"), timeout_s=ECHO_TIMEOUT_S)
    client.close()
    assert reply.kind == "error"
    with pytest.raises(RemoteError, match="asked to fail"):
        reply.raise_if_error()


def test_an_error_reply_marked_user_facing_raises_an_error_written_for_the_user():
    request = Message("mfc", {"mfc": "actor_train"})
    message = "worker 1: NonFiniteError: step 2, MFC actor_train, role actor, rank 1: NaN"
    with pytest.raises(RemoteUserFacingError, match="^worker 1: NonFiniteError: step 2") as raised:
        request.error_reply(message, user_facing=True).raise_if_error()
    assert isinstance(raised.value, UserFacingError) and isinstance(raised.value, RemoteError)
    with pytest.raises(RemoteError) as raised:  # a bug in the worker: not for the user alone
        request.error_reply("worker 1: KeyError: 'packed_logprobs'").raise_if_error()
    assert not isinstance(raised.value, UserFacingError)


def test_hostile_peers_are_dropped_and_the_worker_keeps_serving(tmp_path, caplog):
    caplog.set_level(logging.WARNING, logger="realrl.workers.wire")
    worker = EchoWorker(max_message_bytes=1024**2)
    marker = tmp_path / "unpickled"

    class CreatesFileWhenUnpickled:
        def __reduce__(self):
            return (open, (str(marker), "w"))

    pickle_payload = pickle.dumps(CreatesFileWhenUnpickled())
    attacks: list[tuple[str, list[bytes]]] = []
    attacks.append(("garbage single frame", [b"\x00garbage"]))
    attacks.append(("pickle as envelope", [os.urandom(32), pickle_payload]))
    attacks.append(("pickle as signed envelope", _sign(SECRET, pickle_payload)))
    spec = {"name": "x", "dtype": "float32", "shape": [2], "nbytes": 8}
    attacks.append(("missing buffer frame", _sign(SECRET, _envelope([spec]))))
    attacks.append(("forged MAC", [os.urandom(32), _envelope([spec]), b"\x00" * 8]))
    attacks.append(("other secret", _sign(os.urandom(32), _envelope([spec]), b"\x00" * 8)))
    huge = {"name": "x", "dtype": "float32", "shape": [2**40, 2**40], "nbytes": 8}
    attacks.append(("huge shape", _sign(SECRET, _envelope([huge]), b"\x00" * 8)))
    negative = {"name": "x", "dtype": "float32", "shape": [-2], "nbytes": 8}
    attacks.append(("negative shape", _sign(SECRET, _envelope([negative]), b"\x00" * 8)))
    unknown = {"name": "x", "dtype": "object", "shape": [1], "nbytes": 8}
    attacks.append(("unknown dtype", _sign(SECRET, _envelope([unknown]), pickle_payload[:8])))
    stale = _envelope([], sent_at=time.time() - 3600)
    attacks.append(("stale timestamp", _sign(SECRET, stale)))
    big_frames = [b"\x01" * 600_000] * 3  # each frame fits MAXMSGSIZE, the total does not
    attacks.append(("oversized total", [os.urandom(32), b"{}", *big_frames]))
    sockets = []
    for _, frames in attacks:  # one socket each: warnings are rate-limited per peer and reason
        sockets.append(_connected_dealer(worker.address))
        sockets[-1].send_multipart(frames)
    attacker = _connected_dealer(worker.address)

    valid = _sign(SECRET, _envelope([spec], message_id="ab" * 16), b"\x00" * 8)
    attacker.send_multipart(valid)
    assert attacker.poll(ECHO_TIMEOUT_S * 1000), "the first copy of a valid message is answered"
    attacker.recv_multipart()
    attacker.send_multipart(valid)  # replay

    oversized_sender = _connected_dealer(worker.address)
    oversized_sender.send_multipart([os.urandom(32), b"\x02" * (2 * 1024**2)])  # > MAXMSGSIZE

    expected_reasons = [
        "wrong number of frames (1)",
        "bad MAC",
        "malformed envelope JSON",
        "1 tensors described, 0 buffer frames",
        "needs 4835703278458516698824704 bytes",
        "invalid shape [-2]",
        "unknown dtype 'object'",
        "outside replay_window_s",
        "exceed max_message_bytes",
        "replayed message id " + "ab" * 16,
    ]
    deadline = time.monotonic() + ECHO_TIMEOUT_S
    while time.monotonic() < deadline:
        logged = "\n".join(record.getMessage() for record in caplog.records)
        if all(reason in logged for reason in expected_reasons):
            break
        time.sleep(0.05)
    for reason in expected_reasons:
        assert reason in logged, f"no warning for {reason!r}; got:\n{logged}"
    assert "from peer " in logged

    client = Client(worker.address, SECRET)
    values = torch.arange(6, dtype=torch.int64).reshape(2, 3)
    reply = client.request(Message("request", {"ok": True}, {"v": values}), ECHO_TIMEOUT_S)
    assert reply.header["ok"] is True and torch.equal(reply.tensors["v"], values)
    for socket in [*sockets, attacker]:
        assert socket.poll(100) == 0, "no attack (not even the replay) got an answer"
    assert not marker.exists(), "a pickle payload was unpickled"
    for socket in [*sockets, attacker, oversized_sender, client]:
        socket.close()
    worker.stop()


def test_warnings_about_one_peer_are_rate_limited(caplog):
    caplog.set_level(logging.WARNING, logger="realrl.workers.wire")
    server = Server("tcp://127.0.0.1:*", SECRET)
    attacker = _connected_dealer(server.bound_address)
    for _ in range(20):
        attacker.send_multipart([b"garbage"])
    client = Client(server.bound_address, SECRET)
    time.sleep(0.2)
    client.send(Message("ping"))
    received = server.recv(timeout_s=ECHO_TIMEOUT_S)
    assert received is not None and received[1].kind == "ping"
    warnings = [record for record in caplog.records if "wrong number of frames" in record.message]
    assert len(warnings) == 1
    for socket in (attacker, client, server):
        socket.close()


def test_async_client_matches_out_of_order_replies_across_workers():
    workers = [EchoWorker(reply_in_batches_of=3) for _ in range(2)]

    async def main() -> list[list[Message]]:
        clients = [AsyncClient(worker.address, SECRET) for worker in workers]
        requests = [
            client.request(Message("request", {"index": index}, {"x": torch.full((2,), index)}), 30)
            for client in clients
            for index in range(3)
        ]
        replies = await asyncio.gather(*requests)
        for client in clients:
            client.close()
        return replies

    replies = asyncio.run(main())
    for worker in workers:
        worker.stop()
    assert [reply.header["index"] for reply in replies] == [0, 1, 2, 0, 1, 2]
    for reply in replies:
        assert torch.equal(reply.tensors["x"], torch.full((2,), reply.header["index"]))


def test_async_request_times_out_with_a_helpful_error():
    silent = Server("tcp://127.0.0.1:*", SECRET)

    async def main() -> None:
        client = AsyncClient(silent.bound_address, SECRET)
        try:
            await client.request(Message("request"), timeout_s=0.3)
        finally:
            client.close()

    with pytest.raises(TimeoutError, match="no reply from tcp://127.0.0.1"):
        asyncio.run(main())
    silent.close()


def test_run_secret_file_is_private_and_loadable(tmp_path, monkeypatch):
    monkeypatch.delenv(environment.RUN_SECRET, raising=False)
    secret = create_run_secret(tmp_path)
    path = tmp_path / ".secret"
    assert len(secret) == 32
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert sorted(entry.name for entry in tmp_path.iterdir()) == [".secret"]
    assert load_run_secret(tmp_path) == secret
    with pytest.raises(FileExistsError, match="already has a secret"):
        create_run_secret(tmp_path)
    assert load_run_secret(tmp_path) == secret
    path.chmod(0o640)
    with pytest.raises(PermissionError, match="chmod 600"):
        load_run_secret(tmp_path)


def test_run_secret_from_environment_takes_precedence(tmp_path, monkeypatch):
    file_secret = create_run_secret(tmp_path)
    other_secret = os.urandom(32)
    monkeypatch.setenv(environment.RUN_SECRET, run_secret_env(other_secret)[environment.RUN_SECRET])
    assert load_run_secret(tmp_path) == other_secret != file_secret
    assert load_run_secret() == other_secret
    monkeypatch.setenv(environment.RUN_SECRET, "abcd")
    with pytest.raises(ValueError, match="holds 2 bytes"):
        load_run_secret(Path(tmp_path))
