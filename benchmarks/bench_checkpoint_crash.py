"""Kill -9 a run at random moments while it writes checkpoints, and resume it (issue 26, item 3).

    python benchmarks/bench_checkpoint_crash.py --trials 20 [--seed 0] [--work-dir DIR]

Runs the recoverable ppo-math settings of the end-to-end tests (a critic with value
normalisation, an adaptive KL controller, an EMA reference, two workers) with a tiny random
model for `2 * trials + 2` steps: once uninterrupted, keeping every checkpoint, then as one chain
of `trials` kills (`tests/e2e/crash_trials.py`): each launch is SIGKILLed, launcher, master and
workers at once, at a random moment while it writes a checkpoint, and the next one resumes with
`recover_mode=resume`. After every kill the newest complete checkpoint must hold the reference
run's state for its step bit for bit, the next launch must resume from it, and the last launch
must end with the reference run's weights and metrics.

Prints one line per kill (how far into the save it landed: `writing` before the rename,
`pruning` after it while an old checkpoint is deleted, `after` once the save was done) and a
summary; a violation stops it with the failed assertion (exit 1).
"""

from __future__ import annotations

import argparse
import collections
import os
import random
import shutil
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "e2e"))

from crash_trials import crash_chain  # noqa: E402
from e2e_helpers import RECOVERABLE_PPO, describe, run_cli  # noqa: E402

from realrl.launcher.defaults import fresh_default_model  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trials", type=int, default=20, help="kills in the chain")
    parser.add_argument("--seed", type=int, default=0, help="seed of the kill moments")
    parser.add_argument("--work-dir", type=Path, help="default: a temporary folder, removed after")
    args = parser.parse_args()
    work = args.work_dir or Path(tempfile.mkdtemp(prefix="realrl-crash-"))
    env = {**os.environ, "REALRL_CACHE": str(work / "cache"), "OMP_NUM_THREADS": "1",
           "PYTHONUNBUFFERED": "1"}
    total_steps = 2 * args.trials + 2
    settings = [f"actor.path={fresh_default_model(work / 'model')}", *RECOVERABLE_PPO,
                f"total_train_steps={total_steps}"]
    print(f"reference run: {total_steps} steps, every checkpoint kept ({work / 'reference'})")
    reference = run_cli("ppo-math", [*settings, "save_freq_steps=1", "checkpoint.keep_last=0",
                                     f"output_root={work / 'reference'}"], env, timeout_s=3600)
    if reference.returncode != 0:
        print(describe(reference))
        return 1
    outcomes = crash_chain(args.trials, settings, work / "reference" / "ppo-math" / "trial0",
                           work / "chain", env, random.Random(args.seed),
                           report=lambda line: print(line, flush=True))
    landed = collections.Counter(outcome.landed for outcome in outcomes)
    delays_ms = [outcome.delay_s * 1000 for outcome in outcomes]
    print(f"{len(outcomes)} kills ({', '.join(f'{n} {k}' for k, n in sorted(landed.items()))}; "
          f"{min(delays_ms):.0f} / {statistics.median(delays_ms):.0f} / {max(delays_ms):.0f} ms "
          f"into the save, min / median / max): after every one the newest complete checkpoint "
          f"equalled the reference and the run resumed from it; the last launch ended "
          f"bit-identical to the reference ({total_steps} steps)")
    if args.work_dir is None:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
