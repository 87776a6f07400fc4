"""Reward sources through the real CLI: a weighted sum of the rule reward and an HTTP reward
service, that service failing (a garbage answer, a timeout), and the chain `rw` -> ppo-rlhf
on the reward model it wrote.

The service runs in this test process on a free port: it scores as `examples/reward_server.py`
does (its `score_request`) until it has answered `good_requests` requests, then fails as told.
A failing service must stop the run with an error that names the URL, what went wrong and
the fix; the run exits with no process left behind, and the checkpoint written before the
failure stays complete.
"""

from __future__ import annotations

import importlib.util
import json
import random
import re
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from e2e_helpers import (
    REPO_ROOT,
    assert_traceback_only_in_logs,
    describe,
    kill_leftovers,
    processes_mentioning,
    read_metrics,
)
from e2e_helpers import run_cli as run

from realrl.workers.recovery import complete_checkpoints

# GRPO without reference or critic: the fewest MFCs; both workers run every MFC, so
# remote_inf sends one request per worker and step.
TINY_GRPO = ["ppo.disable_value=true", "ppo.adv_estimator=grpo", "ppo.kl_ctl=0",
             "dataset.batch_size=4", "group_size=2", "gen.max_new_tokens=4",
             "n_devices_per_node=2", "allocation_mode=d2"]


def example_server_module():
    spec = importlib.util.spec_from_file_location(
        "example_reward_server", REPO_ROOT / "examples" / "reward_server.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class RewardService:
    """The example service's scoring for the first `good_requests` requests, then `failure`:
    "garbage" (HTTP 200 with an HTML page) or "hang" (no answer for `hang_s`)."""

    def __init__(self, good_requests: int, failure: str, hang_s: float = 5.0):
        score_request = example_server_module().score_request
        self.requests = 0
        self.authorizations: set[str | None] = set()  # the Authorization headers seen
        service = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):  # noqa: N802
                body = self.rfile.read(int(self.headers["Content-Length"]))
                service.requests += 1
                service.authorizations.add(self.headers.get("Authorization"))
                if service.requests <= good_requests:
                    self._send(json.dumps({"rewards": score_request(body)}).encode())
                elif failure == "garbage":
                    self._send(b"<html><body>Service Unavailable</body></html>")
                else:
                    time.sleep(hang_s)

            def _send(self, data):
                self.send_response(200)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args):
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}/score"

    def __enter__(self):
        threading.Thread(target=self.httpd.serve_forever, args=(0.05,), daemon=True).start()
        return self

    def __exit__(self, *exc):
        self.httpd.shutdown()
        self.httpd.server_close()


def run_ppo(overrides, tiny_model, cli_env, tmp_path, extra_env=None):
    run_dir = tmp_path / "ppo-math" / "trial0"
    try:
        result = run("ppo-math", [f"actor.path={tiny_model}", f"output_root={tmp_path}",
                                  *TINY_GRPO, *overrides], {**cli_env, **(extra_env or {})})
        leftovers = processes_mentioning(str(run_dir))
    finally:
        kill_leftovers(str(run_dir))
    return result, run_dir, leftovers


def test_a_weighted_sum_trains_then_a_garbage_answer_stops_the_run_intact(
    tiny_model, cli_env, tmp_path
):
    with RewardService(good_requests=2, failure="garbage") as service:
        result, run_dir, leftovers = run_ppo(
            ["reward.sources=[rule,remote]", f"reward.remote.url={service.url}",
             "reward.rule.weight=0.25", "reward.remote.weight=0.75", "total_train_steps=3",
             "save_freq_steps=1", "reward.remote.token_env=REALRL_TEST_REWARD_TOKEN"],
            tiny_model, cli_env, tmp_path, {"REALRL_TEST_REWARD_TOKEN": "s3cret-token"})
    # Every request carried the token from the variable, which the run directory never holds.
    assert service.authorizations == {"Bearer s3cret-token"}, service.authorizations
    assert "s3cret-token" not in (run_dir / "config.yaml").read_text()
    assert result.returncode == 1, describe(result)
    output = result.stderr + result.stdout
    assert f"the reward service at {service.url} did not score" in output, describe(result)
    assert "its answer is not JSON: '<html><body>Service Unavailable</body></html>'" in output
    assert 'Fix: the service must answer HTTP 200 with {"rewards": [number, ...]}' in output
    assert "1 try (not retried)" in output
    # One message, naming the failing worker and MFC; the tracebacks are in the logs only.
    assert re.search(r"stopping the run: worker \d: RemoteRewardError: step 2, MFC remote_inf, "
                     r"role \w+, rank \d: the reward service", result.stderr), describe(result)
    failed = [path for path in (run_dir / "logs").glob("worker*.log")
              if "RemoteRewardError" in path.read_text()]
    assert failed, describe(result)
    assert_traceback_only_in_logs(result, [run_dir / "logs" / "master.log", *failed])
    assert leftovers == {}, f"processes left behind: {leftovers}"
    # Step 1 trained on 0.25 * rule + 0.75 * remote; step 2's rollout met the garbage.
    (record,) = read_metrics(run_dir)
    rule, remote = record["reward_sum/rule_mean"], record["reward_sum/remote_mean"]
    assert record["reward/task_mean"] == pytest.approx(0.25 * rule + 0.75 * remote, abs=1e-6)
    assert record["remote_inf/reward_mean"] == pytest.approx(remote)
    assert record["rew_inf/task_mean"] == pytest.approx(rule)
    assert [path.name for path in complete_checkpoints(run_dir)] == ["step000001"]
    assert (run_dir / "checkpoints" / "step000001" / "actor" / "model.safetensors").is_file()
    assert not list((run_dir / "checkpoints").glob("*.tmp"))


@pytest.mark.slow
def test_a_service_that_does_not_answer_is_retried_then_stops_the_run(
    tiny_model, cli_env, tmp_path
):
    with RewardService(good_requests=0, failure="hang", hang_s=3.0) as service:
        result, run_dir, leftovers = run_ppo(
            ["reward.sources=[remote]", f"reward.remote.url={service.url}",
             "reward.remote.timeout_s=0.5", "reward.remote.max_retries=1",
             "reward.remote.backoff_s=0.1", "total_train_steps=2"],
            tiny_model, cli_env, tmp_path)
    assert result.returncode == 1, describe(result)
    output = result.stderr + result.stdout
    assert f"the reward service at {service.url} did not score" in output, describe(result)
    assert "after 2 tries" in output and "timed out after 0.5 s" in output
    assert "raise reward.remote.timeout_s or reward.remote.max_retries" in output
    assert leftovers == {}, f"processes left behind: {leftovers}"
    assert not (run_dir / "metrics.jsonl").is_file() or read_metrics(run_dir) == []
    assert (run_dir / "config.yaml").is_file() and (run_dir / "logs" / "master.log").is_file()


LETTERS, DIGITS = "abcdefghijklmnopqrstuvwxyz+-*/=()., ?:", "0123456789"


def write_digit_preference_data(directory, seed: int = 0) -> tuple[str, str]:
    """Pairs whose preferred answer is the rejected one with some characters turned into digits
    (a preference the tiny policy can act on within a few steps: digits are a fifth of its
    vocabulary), and one-turn chat prompts (`messages`, no answer) for ppo-rlhf."""
    rng = random.Random(seed)
    pairs, chats = [], []
    for _ in range(64):
        prompt = f"{rng.randint(0, 99)}+{rng.randint(0, 99)}="
        rejected = ["".join(rng.choice(LETTERS) for _ in range(rng.randint(1, 4)))
                    for _ in range(2)]
        preferred = []
        for text in rejected:
            chars = list(text)
            for index in rng.sample(range(len(chars)), rng.randint(1, len(chars))):
                chars[index] = rng.choice(DIGITS)
            preferred.append("".join(chars))
        pairs.append({"prompt": prompt, "pos_answers": preferred, "neg_answers": rejected})
        chats.append({"messages": [{"role": "user", "content": prompt}]})
    paths = directory / "pairs.jsonl", directory / "chats.jsonl"
    for path, records in zip(paths, (pairs, chats)):
        path.write_text("".join(json.dumps(record) + "\n" for record in records))
    return str(paths[0]), str(paths[1])


@pytest.mark.slow
def test_ppo_rlhf_on_an_rw_reward_model_raises_its_score(tiny_model, cli_env, tmp_path):
    pairs, chats = write_digit_preference_data(tmp_path)
    rw = run("rw", [f"model.path={tiny_model}", f"output_root={tmp_path}", f"dataset.path={pairs}",
                    "dataset.batch_size=16", "total_train_steps=10", "model.optimizer.lr=3e-3",
                    "n_devices_per_node=2"], cli_env)
    assert rw.returncode == 0, describe(rw)
    assert read_metrics(tmp_path / "rw" / "trial0")[-1]["trainDefault/accuracy"] > 0.9
    reward_model = tmp_path / "rw" / "trial0" / "checkpoints" / "step000010" / "default"
    # The reward model on worker 1 alone, with running normalisation: the actor trains on
    # normalised scores, and rm_inf reports the raw ones.
    result = run("ppo-rlhf", [
        f"actor.path={tiny_model}", f"rm.path={reward_model}", f"output_root={tmp_path}",
        f"dataset.path={chats}", "reward.model.normalize=running", "ppo.disable_value=true",
        "ppo.adv_estimator=grpo", "ppo.kl_ctl=0", "dataset.batch_size=8", "group_size=4",
        "gen.max_new_tokens=4", "total_train_steps=12", "actor.optimizer.lr=3e-3",
        "n_devices_per_node=2", "allocation_mode=rm_inf:d1@1,*:d2"], cli_env)
    assert result.returncode == 0, describe(result)
    run_dir = tmp_path / "ppo-rlhf" / "trial0"
    plan = json.loads((run_dir / "plan.json").read_text())
    assert plan["allocations"]["rm_inf"]["mesh"]["ranks"] == [1]
    metrics = read_metrics(run_dir)
    scores = [record["rm_inf/score_mean"] for record in metrics]
    first, last = sum(scores[:3]) / 3, sum(scores[-3:]) / 3
    assert last - first > 0.5, scores
    # Step 1's running statistics are its own batch's: normalised rewards of mean 0.
    assert metrics[0]["rm_inf/running_mean"] == pytest.approx(scores[0], abs=1e-5)
    assert metrics[0]["rm_inf/reward_mean"] == pytest.approx(0.0, abs=1e-5)
    for record in metrics:
        assert record["reward/task_mean"] == pytest.approx(record["rm_inf/reward_mean"], abs=1e-5)
    samples = [json.loads(line) for line in (run_dir / "samples.jsonl").read_text().splitlines()]
    assert samples and all(re.fullmatch(r"\d+\+\d+=", sample["prompt"]) for sample in samples)
