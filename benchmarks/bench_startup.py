"""Start-up of a local run with and without the fork server (`realrl.launcher.forkserver`).

Runs the real CLI, `ppo-math` on the built-in defaults cut to one step (2 model workers and
the master), `--rounds` times each way, interleaved (on, off, on, off, ...), and reports per
way the median of:

- ready: seconds from the command to the master's "all N workers ready" line;
- total: seconds from the command to the launcher's exit;
- cpu: CPU seconds (user + system) of the launcher and every process below it, from
  `os.wait4` (the fork server reaps its children, the launcher reaps the server).

    .venv/bin/python benchmarks/bench_startup.py --rounds 5 --output /tmp/startup.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from soak import machine  # the machine description every benchmark result carries

REPO_ROOT = Path(__file__).resolve().parents[1]
RUN = ["ppo-math", "wandb.mode=disabled", "tensorboard=false", "total_train_steps=1",
       "dataset.batch_size=4", "group_size=2", "gen.max_new_tokens=4"]


def one_run(fork_server: bool, output_root: Path) -> dict[str, float]:
    env = {**os.environ, "REALRL_FORK_SERVER": "1" if fork_server else "0"}
    started = time.monotonic()
    process = subprocess.Popen(
        [sys.executable, "-m", "realrl.apps.quickstart", *RUN, f"output_root={output_root}"],
        cwd=REPO_ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    ready: list[float] = []

    def read() -> None:
        assert process.stdout is not None
        for line in process.stdout:
            if "workers ready" in line and not ready:
                ready.append(time.monotonic() - started)

    reader = threading.Thread(target=read)
    reader.start()
    _, status, usage = os.wait4(process.pid, 0)
    total = time.monotonic() - started
    reader.join()
    process.returncode = os.waitstatus_to_exitcode(status)
    if process.returncode != 0 or not ready:
        raise RuntimeError(f"the run exited with {process.returncode} (ready: {ready})")
    return {"ready_s": ready[0], "total_s": total, "cpu_s": usage.ru_utime + usage.ru_stime}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--output", type=Path)
    args = parser.parse_args()
    runs: dict[str, list[dict[str, float]]] = {"fork server": [], "own interpreters": []}
    with tempfile.TemporaryDirectory() as scratch:
        one_run(True, Path(scratch) / "warm-up")  # compiled bytecode, page cache
        for round_index in range(args.rounds):
            for fork_server, name in ((True, "fork server"), (False, "own interpreters")):
                root = Path(scratch) / f"{round_index}-{int(fork_server)}"
                runs[name].append(one_run(fork_server, root))
                print(name, runs[name][-1], flush=True)
    summary = {name: {key: statistics.median(run[key] for run in values)
                      for key in ("ready_s", "total_s", "cpu_s")}
               for name, values in runs.items()}
    print("| start | ready (s) | total (s) | CPU (s) |\n|---|---|---|---|")
    for name, row in summary.items():
        print(f"| {name} | {row['ready_s']:.2f} | {row['total_s']:.2f} | {row['cpu_s']:.2f} |")
    if args.output is not None:
        args.output.write_text(json.dumps({"machine": machine(), "command": RUN, "runs": runs,
                                           "median": summary}, indent=1))


if __name__ == "__main__":
    main()
