"""Rendezvous ports come from below the kernel's ephemeral range (`realrl.api.ports`)."""

from __future__ import annotations

import socket

from realrl.api import ports


def test_a_free_port_is_below_the_ephemeral_range_and_bindable(tmp_path, monkeypatch):
    range_file = tmp_path / "ip_local_port_range"
    range_file.write_text("32768\t60999\n")
    monkeypatch.setattr(ports, "EPHEMERAL_RANGE_FILE", range_file)
    chosen = {ports.free_port() for _ in range(20)}
    assert all(ports.LOWEST_PORT <= port < 32768 for port in chosen)
    assert len(chosen) > 1  # random, not the same port for two runs started together
    port = chosen.pop()
    with socket.socket() as server:
        server.bind(("127.0.0.1", port))


def test_without_room_below_the_range_the_kernel_chooses(tmp_path, monkeypatch):
    range_file = tmp_path / "ip_local_port_range"
    range_file.write_text("1024 65535\n")
    monkeypatch.setattr(ports, "EPHEMERAL_RANGE_FILE", range_file)
    assert ports.free_port() >= 1024
    monkeypatch.setattr(ports, "EPHEMERAL_RANGE_FILE", tmp_path / "missing")
    assert ports.ephemeral_low() == ports.DEFAULT_EPHEMERAL_LOW
