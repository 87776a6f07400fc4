"""The fork server (`realrl.launcher.forkserver`): a forked child is the process
`python -m` / `python -c` would have started, and a server that cannot start says so.

`test_processes.py` runs every supervision test (exit codes, signals, grandchildren, the
supervisor's SIGKILL, graceful stops) with forked children too; the end-to-end tests run
every local run through it."""

from __future__ import annotations

import io
import json
import os
import signal
import sys
import textwrap
import time
from pathlib import Path

import pytest

from realrl.api.config import ConfigError
from realrl.api.environment import fork_server_enabled
from realrl.launcher.forkserver import ForkServerError, forkable
from realrl.launcher.processes import ProcessFailure, ProcessSpec, ProcessSupervisor

REPO_ROOT = Path(__file__).resolve().parents[2]


def _spec(tmp_path: Path, name: str, argv: list[str], env: dict[str, str]) -> ProcessSpec:
    return ProcessSpec(name, [sys.executable, *argv], {"PYTHONPATH": str(REPO_ROOT), **env},
                       tmp_path / f"{name}.log", f"[{name}]", num_threads=1)


def test_a_forked_child_is_the_process_python_would_have_started(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    code = textwrap.dedent("""
        import json, os, sys
        print(json.dumps({
            "argv": sys.argv, "cwd": os.getcwd(), "stdin": sys.stdin.read(),
            "own_session": os.getsid(0) == os.getpid(), "parent": os.getppid(),
            "name": open("/proc/self/comm").read().strip(), "mine": os.environ["MINE"],
            "imported": "json" in sys.modules, "main": __name__,
        }))
    """)
    (tmp_path / "mymodule.py").write_text("import sys\nprint('module', __name__, sys.argv)\n")
    specs = [_spec(tmp_path, "master", ["-c", code, "a", "b"], {"MINE": "1"}),
             _spec(tmp_path, "worker0", ["-c", code], {"MINE": "2"}),
             _spec(tmp_path, "worker1", ["-m", "mymodule", "--rank", "1"],
                   {"PYTHONPATH": f"{REPO_ROOT}:{tmp_path}"})]
    with ProcessSupervisor(specs, console=io.StringIO(), preload=("json",)) as supervisor:
        supervisor.start()
        server = supervisor._fork_server
        assert server is not None
        assert supervisor.wait(poll_interval_s=0.05) == 0

    seen = {name: json.loads((tmp_path / f"{name}.log").read_text())
            for name in ("master", "worker0")}
    assert seen["master"]["argv"] == ["-c", "a", "b"] and seen["worker0"]["argv"] == ["-c"]
    for name, child in seen.items():
        assert child["cwd"] == str(tmp_path) and child["stdin"] == ""
        assert child["own_session"] and child["main"] == "__main__"
        assert child["parent"] == server.pid  # forked, not started by the supervisor
        assert child["name"] == f"realrl-{name}" and child["imported"]
    assert (seen["master"]["mine"], seen["worker0"]["mine"]) == ("1", "2")
    # PYTHONPATH differs between the specs, so the server has the supervisor's own; the
    # module is found because -m looks in the working directory first, as python does.
    assert (tmp_path / "worker1.log").read_text().splitlines() == [
        f"module __main__ {[str(tmp_path / 'mymodule.py'), '--rank', '1']}"]


def test_a_fork_server_that_cannot_import_its_modules_stops_the_start_and_says_so(tmp_path):
    specs = [_spec(tmp_path, "master", ["-c", "pass"], {})]
    supervisor = ProcessSupervisor(specs, console=io.StringIO(),
                                   preload=("realrl_no_such_module",))
    with pytest.raises(ForkServerError) as error:
        supervisor.start()
    message = str(error.value)
    assert "cannot start process 'master': the fork server" in message
    assert "exited with code 1" in message and "REALRL_FORK_SERVER=0" in message
    supervisor.stop()


def test_a_killed_fork_server_takes_its_children_and_the_run_stops(tmp_path, caplog):
    specs = [_spec(tmp_path, "worker0", ["-c", "import time; time.sleep(60)"], {})]
    with ProcessSupervisor(specs, console=io.StringIO(), preload=("json",)) as supervisor:
        supervisor.start()
        server = supervisor._fork_server
        assert server is not None
        child = supervisor.pids["worker0"]
        os.kill(server.pid, signal.SIGKILL)
        with pytest.raises(ProcessFailure, match="'worker0' .* was killed by SIGKILL"):
            supervisor.wait(poll_interval_s=0.05)
    assert f"the fork server (pid {server.pid}) exited with -9" in caplog.text
    deadline = time.monotonic() + 5
    while _is_alive(child) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _is_alive(child)  # died with its parent


def _is_alive(pid: int) -> bool:
    """False once gone or a zombie (whoever adopted it may not reap it at once)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] not in "ZX"
    except OSError:
        return False


def test_only_this_interpreter_with_m_or_c_is_forked():
    assert forkable([sys.executable, "-m", "realrl.launcher.entry", "--rank", "0"])
    assert forkable([sys.executable, "-c", "pass"])
    assert not forkable(["/usr/bin/python3.9", "-m", "realrl.launcher.entry"])
    assert not forkable([sys.executable, "script.py"])


def test_realrl_fork_server_takes_0_or_1(monkeypatch):
    monkeypatch.setenv("REALRL_FORK_SERVER", "0")
    assert not fork_server_enabled()
    monkeypatch.setenv("REALRL_FORK_SERVER", "1")
    assert fork_server_enabled() == sys.platform.startswith("linux")
    monkeypatch.setenv("REALRL_FORK_SERVER", "yes")
    with pytest.raises(ConfigError, match="REALRL_FORK_SERVER='yes' is neither 0 nor 1"):
        fork_server_enabled()


@pytest.mark.gpu
def test_a_fork_server_refuses_modules_that_initialise_cuda(tmp_path, monkeypatch):
    import torch

    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    (tmp_path / "cuda_at_import.py").write_text("import torch\ntorch.zeros(1, device='cuda')\n")
    specs = [_spec(tmp_path, "worker0", ["-c", "pass"], {})]
    monkeypatch.setenv("PYTHONPATH", f"{REPO_ROOT}:{tmp_path}")
    supervisor = ProcessSupervisor(specs, console=io.StringIO(), preload=("cuda_at_import",))
    with pytest.raises(ForkServerError, match="exited with code 1"):
        supervisor.start()
    supervisor.stop()
