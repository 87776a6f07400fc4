"""Rendezvous through torch's TCPStore: the master hosts it, workers connect to it.

The store carries everything processes must find out about each other: worker ZeroMQ
addresses, readiness, and the run plan; torch.distributed initialises from a prefix of it.
No shared filesystem is needed, so it works across nodes as well as on one machine.
"""

from __future__ import annotations

import datetime
import socket

import torch.distributed as dist


class Rendezvous:
    def __init__(self, host: str, port: int, is_host: bool, world_size: int | None = None,
                 timeout_s: float = 300.0, advertised_host: str | None = None):
        self.store = dist.TCPStore(
            host, port, world_size=world_size, is_master=is_host,
            timeout=datetime.timedelta(seconds=timeout_s), wait_for_workers=False,
        )
        self.port = self.store.port
        self.advertised_host = advertised_host or (
            "127.0.0.1" if host in ("127.0.0.1", "localhost") else socket.gethostname()
        )

    def torch_store(self, prefix: str) -> dist.Store:
        return dist.PrefixStore(prefix, self.store)

    def publish(self, key: str, value: str) -> None:
        self.store.set(key, value)

    def wait_for(self, key: str) -> str:
        """The value of `key`, blocking until someone publishes it (store timeout applies)."""
        self.store.wait([key])
        return self.store.get(key).decode()
