"""The launcher's console: on a terminal (a real pty here) the master's progress line is redrawn
in place and cut to the terminal's width; in a pipe or file every line is written in full."""

from __future__ import annotations

import fcntl
import io
import os
import pty
import select
import struct
import sys
import termios
import textwrap
import tty
from pathlib import Path

import pytest

from realrl.launcher.console import Console
from realrl.launcher.processes import ProcessSpec, ProcessSupervisor
from realrl.workers.metrics_log import progress_line

REPO_ROOT = Path(__file__).resolve().parents[2]
COLUMNS = 80
METRICS = {"reward/task_mean": 0.25, "actor_train/kl_to_ref": 0.0123, "timing/step_s": 1.5,
           **{f"timing/{name}": 0.1 for name in ("actor_gen", "rew_inf", "ref_inf", "critic_inf",
                                                 "actor_train", "critic_train")}}


@pytest.fixture
def terminal():
    """(leader fd to read what was shown, writable follower end) of a raw 80-column pty."""
    leader, follower = pty.openpty()
    tty.setraw(follower)  # bytes as written: no "\n" -> "\r\n"
    fcntl.ioctl(follower, termios.TIOCSWINSZ, struct.pack("HHHH", 24, COLUMNS, 0, 0))
    stream = os.fdopen(follower, "w", encoding="utf-8")
    yield leader, stream
    stream.close()
    os.close(leader)


def read_all(leader: int) -> str:
    chunks = []
    while select.select([leader], [], [], 0.2)[0]:
        chunks.append(os.read(leader, 65536))
    return b"".join(chunks).decode()


def screen(shown: str) -> list[str]:
    """The lines a terminal displays for `shown`: carriage return, erase to end of line, and
    newline, the only controls the console writes."""
    lines, current, column, index = [], [], 0, 0
    while index < len(shown):
        if shown.startswith("\x1b[K", index):
            del current[column:]
            index += 3
            continue
        character = shown[index]
        if character == "\r":
            column = 0
        elif character == "\n":
            lines.append("".join(current))
            current, column = [], 0
        else:
            current[column:column + 1] = [character]
            column += 1
        index += 1
    return lines + (["".join(current)] if current else [])


def test_on_a_terminal_the_progress_line_is_redrawn_in_place_and_fits(terminal):
    leader, stream = terminal
    console = Console(stream)
    full_lines = [progress_line(step, 3, 10.0 * (3 - step), METRICS) for step in (1, 2, 3)]
    assert len(full_lines[0]) > COLUMNS
    console.write_line("[master] ", "12:00:00 INFO all 2 workers ready")
    console.write_line("[master] ", full_lines[0])
    console.write_line("[master] ", full_lines[1])
    console.write_line("[worker 0] ", "12:00:02 INFO a worker speaks")
    console.write_line("[master] ", full_lines[2])
    console.write_line("[master] ", "12:00:03 INFO run finished")
    shown = read_all(leader)

    assert "\n" not in shown.split("step 1/3")[1].split("step 2/3")[0]  # drawn over, no new line
    lines = screen(shown)
    assert lines[0] == "[master] 12:00:00 INFO all 2 workers ready"
    assert lines[1] == "[worker 0] 12:00:02 INFO a worker speaks"  # above the progress line
    assert lines[2].startswith("[master] [############] step 3/3 | eta 0s | reward 0.25 | kl")
    assert lines[3] == "[master] 12:00:03 INFO run finished"
    assert len(lines) == 4 and all(len(line) < COLUMNS for line in lines), lines


def test_a_report_after_an_unfinished_progress_line_starts_on_a_new_line(terminal):
    leader, stream = terminal
    console = Console(stream)
    console.write_line("[master] ", progress_line(1, 3, None, METRICS))
    console.end_progress()
    stream.write("error: process 'worker0' exited with code 1\n")
    stream.flush()
    lines = screen(read_all(leader))
    assert lines[0].startswith("[master] [####........] step 1/3 | eta ? |")
    assert lines[1] == "error: process 'worker0' exited with code 1"


def test_elsewhere_every_line_is_written_in_full():
    stream = io.StringIO()
    console = Console(stream)
    full_lines = [progress_line(step, 2, 5.0, METRICS) for step in (1, 2)]
    for line in full_lines:
        console.write_line("[master] ", line)
    console.end_progress()
    assert stream.getvalue() == "".join(f"[master] {line}\n" for line in full_lines)


def test_the_supervisor_draws_the_masters_progress_on_the_terminal_and_logs_it_in_full(
    tmp_path, terminal
):
    leader, stream = terminal
    lines = [progress_line(step, 3, float(3 - step), METRICS) for step in (1, 2, 3)]
    code = f"""
        import sys
        print("starting", file=sys.stderr, flush=True)
        for line in {lines!r}:
            print(line, flush=True)
        print("done", flush=True)
    """
    spec = ProcessSpec("master", [sys.executable, "-c", textwrap.dedent(code)],
                       {"PYTHONPATH": str(REPO_ROOT)}, tmp_path / "master.log", "[master]")
    with ProcessSupervisor([spec], console=stream) as supervisor:
        supervisor.start()
        assert supervisor.wait(poll_interval_s=0.05) == 0

    shown = screen(read_all(leader))
    assert shown[0] == "[master] starting"
    assert shown[1].startswith("[master] [############] step 3/3 | eta 0s |")
    assert shown[2:] == ["[master] done"]
    assert all(len(line) < COLUMNS for line in shown)
    assert (tmp_path / "master.log").read_text().splitlines() == ["starting", *lines, "done"]
