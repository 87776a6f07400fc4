"""Soak test (issue 26): the default `ppo-math` for thousands of steps, every process watched.

It starts `python -m realrl.apps.quickstart ppo-math total_train_steps=STEPS` (plus any
`key=value` given after the options) and, every `--interval` seconds, reads from /proc for
every process of the run: the launcher, the master, each model worker and their children (the
math verifier's child process, compile workers), found through the launcher's process tree.
Per process: resident memory (`rss`, and its `anon` and `shmem` parts), open file descriptors
(`fds`, `sockets` among them), `threads`, and the bytes of `/dev/shm` files it maps (`shm`;
realrl unlinks its segments once every rank has mapped them, so they are seen only through
`/proc/<pid>/maps`). For the machine: `/dev/shm` in use (every user's), the run's own
`realrl-*` segments (each counted once; how many still have a name), and at the end which of
them were left behind, and which of the run's processes outlived it. The step comes from the
run's `metrics.jsonl`.

Processes are named by role, not by pid (`launcher`, `master`, `worker0`,
`worker0/math_worker`), so a child that is restarted keeps its series; the pids seen under
each name are recorded.

Summary, per process and quantity: the peak over the whole run, and over the second half of
the training steps the least-squares slope per 1000 steps with two noise estimates (the
slope's standard error and the residuals' standard deviation). Growth is flagged when the
fitted rise over that half exceeds both three standard errors and twice the residual spread,
and is at least one whole fd or thread, or `--min-slope-mib` (0.1 MiB per 1000 steps) of
memory: a leak shows as a steady rise, the allocator's or the load's noise as scatter around
a flat line (`soak_summary.py` says why the floor).

    .venv/bin/python benchmarks/soak.py                           # 5000 steps, ~15-25 min
    .venv/bin/python benchmarks/soak.py --steps 300 --interval 2  # a quick check
"""

from __future__ import annotations

import argparse
import datetime
import json
import logging
import os
import platform
import signal
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from soak_summary import MIN_SLOPE_MIB, format_summary, summarise  # noqa: E402

logger = logging.getLogger("soak")
REPO_ROOT = Path(__file__).resolve().parent.parent
SHARED_MEMORY = Path("/dev/shm")
REALRL_SHM_PREFIX = "realrl-"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=5000, help="total_train_steps of the run.")
    parser.add_argument("--interval", type=float, default=5.0, help="Seconds between samples.")
    parser.add_argument("--output", default=None,
                        help="JSON file (default benchmarks/results/soak_<steps>steps.json).")
    parser.add_argument("--work-dir", default="/tmp/realrl-soak",
                        help="Run directory root and the run's console log.")
    parser.add_argument("--timeout-s", type=float, default=4 * 3600.0)
    parser.add_argument("--min-slope-mib", type=float, default=MIN_SLOPE_MIB,
                        help="Memory slopes (MiB per 1000 steps) below this are never growth.")
    parser.add_argument("overrides", nargs="*", help="Extra key=value for the run.")
    args = parser.parse_args(argv)
    if args.output is None:
        args.output = str(REPO_ROOT / "benchmarks" / "results" / f"soak_{args.steps}steps.json")
    return args


def process_table() -> dict[int, tuple[int, list[str], str]]:
    """pid -> (parent pid, argv, name) of every process on the machine."""
    table = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
            argv = Path(f"/proc/{entry}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue  # exited meanwhile
        parent = int(stat.rsplit(")", 1)[1].split()[1])
        name = stat.split("(", 1)[1].rsplit(")", 1)[0]
        table[int(entry)] = (parent, [a.decode(errors="replace") for a in argv if a], name)
    return table


def role_name(argv: list[str], parent_name: str | None, name: str = "") -> str:
    """`master`, `worker<rank>` for realrl's processes (started as interpreters, or forked from
    the fork server, which names them `realrl-<role>`), `fork_server` for that server;
    `<parent>/<program>` for their children."""
    if name.startswith("realrl-") and "realrl.launcher.forkserver" in argv:
        return name.removeprefix("realrl-")
    if "realrl.launcher.forkserver" in argv:
        return "fork_server"
    if "realrl.launcher.entry" in argv:
        if "master" in argv:
            return "master"
        if "--rank" in argv:
            return f"worker{argv[argv.index('--rank') + 1]}"
    programs = [a for a in argv[1:] if a.endswith(".py")] or argv[:1] or ["?"]
    program = Path(programs[0]).stem.lstrip("_") or "?"
    return f"{parent_name}/{program}" if parent_name else program


def run_processes(root_pid: int) -> dict[str, int]:
    """Role name -> pid for the launcher and all its descendants (repeated names get `#2`...)."""
    table = process_table()
    children: dict[int, list[int]] = {}
    for pid, (parent, _, _) in table.items():
        children.setdefault(parent, []).append(pid)
    names: dict[str, int] = {}
    pending = [(root_pid, None)]
    while pending:
        pid, parent_name = pending.pop(0)
        if pid not in table:
            continue
        name = "launcher" if parent_name is None else role_name(table[pid][1], parent_name,
                                                                  table[pid][2])
        base, copy = name, 2
        while name in names:
            name, copy = f"{base}#{copy}", copy + 1
        names[name] = pid
        pending.extend((child, name) for child in sorted(children.get(pid, [])))
    return names


def _status_kib(status: str, key: str) -> int:
    for line in status.splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1])
    return 0


def shm_mappings(pid: int) -> dict[tuple[str, str], tuple[str, int]]:
    """(device, inode) -> (path, mapped bytes) of the /dev/shm files the process maps."""
    mapped: dict[tuple[str, str], tuple[str, int]] = {}
    for line in Path(f"/proc/{pid}/maps").read_text().splitlines():
        fields = line.split(maxsplit=5)
        if len(fields) < 6 or not fields[5].startswith(f"{SHARED_MEMORY}/"):
            continue
        start, end = (int(address, 16) for address in fields[0].split("-"))
        key = (fields[3], fields[4])
        mapped[key] = (fields[5], mapped.get(key, ("", 0))[1] + end - start)
    return mapped


def sample_process(pid: int) -> tuple[dict, dict] | None:
    """One process's quantities (MiB and counts) and its shm mappings; None if it is gone."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
        fd_targets = []
        for fd in os.listdir(f"/proc/{pid}/fd"):
            try:
                fd_targets.append(os.readlink(f"/proc/{pid}/fd/{fd}"))
            except OSError:
                pass  # closed between listing and reading
        mappings = shm_mappings(pid)
    except OSError:
        return None
    def mib(kib: float) -> float:
        return round(kib / 1024, 4)  # a KiB is 0.00098 MiB

    quantities = {
        "pid": pid,
        "rss_mib": mib(_status_kib(status, "VmRSS")),
        "anon_mib": mib(_status_kib(status, "RssAnon")),
        "shmem_mib": mib(_status_kib(status, "RssShmem")),
        "fds": len(fd_targets),
        "sockets": sum(target.startswith("socket:") for target in fd_targets),
        "threads": _status_kib(status, "Threads"),
        "shm_mib": mib(sum(size for _, size in mappings.values()) / 1024),
    }
    return quantities, mappings


def shared_memory_in_use_mib() -> float:
    """MiB of /dev/shm in use: every user's, unlinked-but-mapped files included."""
    usage = os.statvfs(SHARED_MEMORY)
    return (usage.f_blocks - usage.f_bfree) * usage.f_frsize / 2**20


def files_left(segments: dict[str, str]) -> list[str]:
    """Which of the run's /dev/shm files (inode -> path) still have a name there."""
    left = []
    for inode, path in segments.items():
        try:
            if str(os.stat(path).st_ino) == inode:
                left.append(path)
        except OSError:
            pass
    return sorted(left)


class StepCounter:
    """The run's newest step and the mean step time since the last read, from metrics.jsonl."""

    def __init__(self, metrics_file: Path):
        self.metrics_file = metrics_file
        self.offset = 0
        self.step = 0

    def read(self) -> tuple[int, float | None]:
        if not self.metrics_file.is_file():
            return self.step, None
        with open(self.metrics_file, "rb") as stream:
            stream.seek(self.offset)
            data = stream.read()
        complete = data[: data.rfind(b"\n") + 1]
        self.offset += len(complete)
        records = [json.loads(line) for line in complete.splitlines() if line.strip()]
        if not records:
            return self.step, None
        self.step = records[-1]["step"]
        step_times = [r["timing/step_s"] for r in records if "timing/step_s" in r]
        return self.step, (sum(step_times) / len(step_times) if step_times else None)


def take_sample(root_pid: int, started: float, steps: StepCounter,
                segments: dict[str, str]) -> dict:
    """One sample of every process of the run; adds the realrl /dev/shm files that the run
    maps to `segments` (inode -> path)."""
    step, step_s = steps.read()
    processes, run_segments = {}, {}
    for name, pid in run_processes(root_pid).items():
        sampled = sample_process(pid)
        if sampled is None:
            continue
        processes[name], mappings = sampled
        for key, (path, size) in mappings.items():
            if Path(path).name.startswith(REALRL_SHM_PREFIX):
                run_segments[key] = (path, max(size, run_segments.get(key, ("", 0))[1]))
    linked = [path for path, _ in run_segments.values() if not path.endswith(" (deleted)")]
    segments.update({inode: path.removesuffix(" (deleted)")
                     for (_, inode), (path, _) in run_segments.items()})
    return {
        "t_s": round(time.monotonic() - started, 3), "step": step,
        "step_s": None if step_s is None else round(step_s, 4),
        "load_1m": os.getloadavg()[0],
        "dev_shm_used_mib": round(shared_memory_in_use_mib(), 4),
        "run_shm_mib": round(sum(size for _, size in run_segments.values()) / 2**20, 4),
        "run_shm_segments": len(run_segments), "run_shm_named_files": len(linked),
        "processes": processes,
    }


def machine() -> dict:
    cpu = next((line.split(":", 1)[1].strip() for line in
                Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("model name")),
               platform.processor())
    meminfo = Path("/proc/meminfo").read_text()
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO_ROOT,
                            capture_output=True, text=True).stdout.strip()
    return {"cpu": cpu, "cores": os.cpu_count(), "affinity": len(os.sched_getaffinity(0)),
            "memory_gib": round(_status_kib(meminfo, "MemTotal") / 2**20, 1),
            "python": platform.python_version(), "commit": commit}


def still_running(pids: set[int], root_pid: int) -> list[int]:
    """Pids of the run that outlived the launcher (orphans); the launcher itself is reaped."""
    return sorted(pid for pid in pids if pid != root_pid and Path(f"/proc/{pid}").exists()
                  and not Path(f"/proc/{pid}/stat").read_text().split(") ")[1].startswith("Z"))


def write_json(path: Path, result: dict) -> None:
    """One sample a line, after the rest; written whole each time (a temporary file renamed),
    so a reader never sees half."""
    parts = [f"{json.dumps(key)}: {json.dumps(value, indent=1)}"
             for key, value in result.items() if key != "samples"]
    samples = ",\n".join(json.dumps(sample, separators=(",", ":")) for sample in result["samples"])
    parts.append(f'"samples": [\n{samples}\n]')
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = path.with_name(path.name + ".tmp")
    temporary.write_text("{\n" + ",\n".join(parts) + "\n}\n")
    temporary.replace(path)


def watch(process: subprocess.Popen, args: argparse.Namespace, result: dict,
          steps: StepCounter, segments: dict[str, str]) -> None:
    """Sample until the run exits. Every 20 samples the samples so far go to `--output`, so a
    long soak can be read while it runs. Past `--timeout-s`, or on Ctrl-C or SIGTERM, the run
    is asked to stop (SIGTERM) and what was measured is kept."""
    started = time.monotonic()
    try:
        while process.poll() is None:
            if time.monotonic() - started > args.timeout_s and not result.get("stopped"):
                result["stopped"] = f"--timeout-s={args.timeout_s} passed"
                process.terminate()
            sample = take_sample(process.pid, started, steps, segments)
            result["samples"].append(sample)
            if len(result["samples"]) % 20 == 1:
                logger.info("step %d/%d, %d processes, load %.1f", sample["step"],
                            args.steps, len(sample["processes"]), sample["load_1m"])
                write_json(Path(args.output), result)
            time.sleep(args.interval)
    except KeyboardInterrupt:
        result["stopped"] = "interrupted"
        process.terminate()
    process.wait()
    result["wall_s"] = round(time.monotonic() - started, 1)


def run_soak(args: argparse.Namespace) -> dict:
    work_dir = Path(args.work_dir).resolve()
    trial = f"soak-{args.steps}-{datetime.datetime.now():%Y%m%d-%H%M%S}"
    command = [sys.executable, "-m", "realrl.apps.quickstart", "ppo-math",
               f"total_train_steps={args.steps}", f"output_root={work_dir}",
               "experiment_name=soak", f"trial_name={trial}", *args.overrides]
    work_dir.mkdir(parents=True, exist_ok=True)
    log_file = work_dir / f"{trial}.log"
    segments: dict[str, str] = {}  # inode -> path of every realrl /dev/shm file the run mapped
    result = {"command": command[1:], "steps": args.steps, "interval_s": args.interval,
              "machine": machine(), "started": datetime.datetime.now().isoformat(" ", "seconds"),
              "load_1m_start": os.getloadavg()[0], "log": str(log_file), "samples": []}
    steps = StepCounter(work_dir / "soak" / trial / "metrics.jsonl")
    with open(log_file, "w") as log:
        process = subprocess.Popen(command, cwd=REPO_ROOT, stdout=log, stderr=subprocess.STDOUT)
        watch(process, args, result, steps, segments)
    seen = {process_sample["pid"] for sample in result["samples"]
            for process_sample in sample["processes"].values()}
    result.update(returncode=process.returncode, final_step=steps.read()[0],
                  load_1m_end=os.getloadavg()[0], orphans=still_running(seen, process.pid),
                  realrl_shm_files_left=files_left(segments))
    return result


def _interrupt(signum, frame) -> None:
    raise KeyboardInterrupt


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", datefmt="%H:%M:%S")
    args = parse_args(argv)
    signal.signal(signal.SIGTERM, _interrupt)  # `kill` of a run under nohup, which ignores ^C
    result = run_soak(args)
    result["summary"] = summarise(result, args.min_slope_mib)
    write_json(Path(args.output), result)
    sys.stdout.write(format_summary(result) + f"\nraw samples: {args.output}\n")
    return 0 if result["returncode"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
