"""Test-only fault injection: a model worker that stays busy inside an MFC call.

Python imports `sitecustomize` at start-up from the first folder of the path that has one, so
every process of a CLI run whose PYTHONPATH starts with this folder runs this file (the
launcher, the master, the workers). With REALRL_TEST_STALL="<mfc>@<rank>" model worker <rank>
sleeps in `stall_inside_mfc` when a request for MFC <mfc> arrives, before it runs it: a worker
that is alive (its heartbeat thread answers) and late, as one stuck in a long call would be.
`tests/e2e/test_watchdog_cli.py` uses it; nothing else sets the variable.
"""

import importlib.abc
import importlib.util
import os
import sys
import time

STALL = os.environ.get("REALRL_TEST_STALL")
PATCHED_MODULE = "realrl.workers.model_worker"


def stall_inside_mfc(seconds: float) -> None:
    time.sleep(seconds)


def _patch(module) -> None:
    mfc_name, rank = STALL.split("@")
    run_mfc = module.ModelWorker._run_mfc

    def _run_mfc(self, message):
        if self.rank == int(rank) and message.header.get("mfc") == mfc_name:
            stall_inside_mfc(600.0)
        return run_mfc(self, message)

    module.ModelWorker._run_mfc = _run_mfc


class _PatchOnImport(importlib.abc.MetaPathFinder):
    """Finds `PATCHED_MODULE` as usual and patches it right after it has run."""

    def find_spec(self, fullname, path, target=None):
        if fullname != PATCHED_MODULE:
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(fullname)
        load = spec.loader.exec_module

        def exec_module(module):
            load(module)
            _patch(module)

        spec.loader.exec_module = exec_module
        return spec


if STALL:
    sys.meta_path.insert(0, _PatchOnImport())
