"""The launcher's console: where the prefixed output lines of every process meet the user.

Why: the master prints a progress line per step (`realrl.workers.metrics_log.progress_line`),
about 240 characters with every MFC's seconds. In a log file or a pipe each of those lines is
worth keeping; on a terminal a new line per step scrolls everything else away. So on a
terminal the console keeps one progress line at the bottom, redrawn in place (`\\r`, erase to
the end of the line) and cut to the terminal's width with a bar in front; every other line is
printed above it. Elsewhere (a pipe, a file, a test's StringIO) each line is written in full.
The log files never pass through here: `ProcessSupervisor` writes them itself.
"""

from __future__ import annotations

import os
import threading
from typing import IO

from realrl.workers.metrics_log import parse_progress_line

BAR_WIDTH = 12
DEFAULT_COLUMNS = 100
_ERASE_LINE = "\x1b[K"


def _is_terminal(stream: IO[str]) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):  # no isatty, or closed
        return False


class Console:
    """Thread-safe writer of prefixed lines; see the module docstring."""

    def __init__(self, stream: IO[str]):
        self.stream = stream
        self.is_terminal = _is_terminal(stream)
        self._lock = threading.Lock()
        self._progress: str | None = None  # the progress line on the screen, not yet ended

    def write_line(self, prefix: str, line: str) -> None:
        """Write one line of a process (`prefix` ends with a space, or is empty)."""
        with self._lock:
            try:
                progress = parse_progress_line(line) if self.is_terminal else None
                if progress is None:
                    self._write_above_progress(prefix + line)
                else:
                    self._draw_progress(prefix, line, *progress)
                self.stream.flush()
            except (OSError, ValueError):  # console gone: the caller keeps draining into the log
                pass

    def end_progress(self) -> None:
        """Leave the progress line on the screen and go to a new line (before a report)."""
        with self._lock:
            if self._progress is not None:
                try:
                    self.stream.write("\n")
                    self.stream.flush()
                except (OSError, ValueError):
                    pass
                self._progress = None

    def _write_above_progress(self, text: str) -> None:
        if self._progress is None:
            self.stream.write(text + "\n")
            return
        self.stream.write(f"\r{_ERASE_LINE}{text}\n{self._progress}")

    def _draw_progress(self, prefix: str, line: str, step: int, total: int) -> None:
        filled = min(BAR_WIDTH, BAR_WIDTH * step // max(total, 1))
        bar = "#" * filled + "." * (BAR_WIDTH - filled)
        text = fit(f"{prefix}[{bar}] {line}", self._columns() - 1)
        self.stream.write(f"\r{text}{_ERASE_LINE}")
        self._progress = text
        if step >= total:  # the last step: its line stays, like any other
            self.stream.write("\n")
            self._progress = None

    def _columns(self) -> int:
        try:
            return os.get_terminal_size(self.stream.fileno()).columns or DEFAULT_COLUMNS
        except (AttributeError, OSError, ValueError):
            return DEFAULT_COLUMNS


def fit(text: str, width: int) -> str:
    """`text` cut to `width` characters, ending in '..' when cut."""
    if len(text) <= width:
        return text
    return text[: max(0, width - 2)] + ".."
