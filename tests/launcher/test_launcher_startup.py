"""The launcher process starts the run without importing torch or transformers.

Importing them costs the launcher ~3 s on a small CPU (measured: 4.9 s -> 0.5 s from the
command to starting the processes), all of it before any worker can start. Only a machine
with a GPU driver imports torch in the launcher, to count its GPUs.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap


def test_launching_a_run_imports_neither_torch_nor_transformers(tmp_path):
    script = textwrap.dedent(
        f"""
        import sys
        import realrl.api.config as config
        import realrl.launcher.processes as processes

        class Started(Exception):
            pass

        def start(self):
            raise Started

        config.may_have_gpus = lambda: False  # as on a machine without a GPU driver
        processes.ProcessSupervisor.start = start
        from realrl.apps import quickstart

        try:
            quickstart.main(["ppo-math", "output_root={tmp_path}", "wandb.mode=disabled"])
        except Started:
            pass
        heavy = sorted(m for m in ("torch", "transformers") if m in sys.modules)
        print("imported:", heavy)
        """
    )
    result = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr
    assert "imported: []" in result.stdout, result.stdout + result.stderr
    assert (tmp_path / "ppo-math").is_dir()  # the run directory was prepared
    # The launch plan is built once: its auto allocation is logged once.
    assert result.stderr.count("allocation_mode=auto") == 1, result.stderr


def test_gpus_are_probed_only_where_a_driver_or_visible_device_may_exist(monkeypatch):
    from realrl.api import config

    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    assert not config.may_have_gpus()
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    monkeypatch.setattr(config.os.path, "exists", lambda path: path == "/dev/nvidiactl")
    assert config.may_have_gpus()
    monkeypatch.setattr(config.os.path, "exists", lambda path: False)
    assert not config.may_have_gpus()
