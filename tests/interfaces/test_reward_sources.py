"""The reward-source interfaces: the weighted sum (hand-computed), the reward model's scores
with fixed and running normalisation and clipping (running statistics the same on 1 and 2
gloo data-parallel ranks), and the remote source against the example server of
`examples/reward_server.py`, run in this process on a free port.
"""

from __future__ import annotations

import importlib.util
import json
import math
import threading
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from interface_helpers import EOS_ID, build_model, make_engine
from rank_processes import start_ranks

from realrl.api.data import SequenceSample
from realrl.api.dfg import MicroBatchSpec
from realrl.api.reward_config import ModelRewardConfig, RemoteRewardConfig, ScoreNormalization
from realrl.interfaces.configs import RewardSumConfig
from realrl.interfaces.model_reward import ModelRewardInterface
from realrl.interfaces.remote_reward import RemoteRewardInterface
from realrl.interfaces.reward_sum import RewardSumInterface
from realrl.rewards.remote import RemoteRewardClient, RemoteRewardError
from realrl.workers.model_worker import TokenizerOnlyEngine

REPO_ROOT = Path(__file__).resolve().parents[2]


def per_response(**keys: list[float]) -> SequenceSample:
    """Two samples, of two responses and one, with one value per response in each key."""
    return SequenceSample.from_tensors(
        ids=["a", "b"], seqlens={key: [[1, 1], [1]] for key in keys},
        data={key: torch.tensor(values) for key, values in keys.items()},
    )


def test_reward_sum_weights_each_source_and_reports_its_mean():
    data = per_response(rule_rewards=[1.0, 0.0, 1.0], model_rewards=[0.5, -2.0, 3.0],
                        remote_rewards=[0.0, 0.0, 0.4])
    config = RewardSumConfig({"rule": 0.25, "model": 2.0, "remote": -1.0})
    result = RewardSumInterface(config).inference(None, data, MicroBatchSpec())
    # 0.25 * 1 + 2 * 0.5 - 0 = 1.25;  0.25 * 0 + 2 * -2 - 0 = -4;  0.25 * 1 + 2 * 3 - 0.4 = 5.85
    torch.testing.assert_close(result.data.data["rewards"], torch.tensor([1.25, -4.0, 5.85]))
    assert result.data.seqlens["rewards"] == [[1, 1], [1]] and result.data.ids == ["a", "b"]
    assert result.stats == pytest.approx(
        {"rule_mean": 2 / 3, "model_mean": 0.5, "remote_mean": 0.4 / 3})


def test_reward_sum_names_a_missing_source_key():
    data = per_response(rule_rewards=[1.0, 0.0, 1.0])
    with pytest.raises(KeyError, match="model_rewards"):
        RewardSumInterface(RewardSumConfig({"rule": 1.0, "model": 1.0})).inference(
            None, data, MicroBatchSpec())


def rollouts() -> SequenceSample:
    """Three prompt + response sequences of token ids (vocabulary 40), each ending in EOS."""
    sequences = [[4, 13, 5, 6, EOS_ID], [4, 13, 5, 7, 8, EOS_ID], [30, 3, 9, EOS_ID]]
    return SequenceSample.from_tensors(
        ids=["a", "b"], seqlens={"packed_input_ids": [[5, 6], [4]]},
        data={"packed_input_ids": torch.tensor([t for s in sequences for t in s])},
    )


def last_token_values(model, data: SequenceSample) -> torch.Tensor:
    cu_seqlens = data.cu_seqlens("packed_input_ids")
    with torch.no_grad():
        values = model(data.data["packed_input_ids"], cu_seqlens)
    return values[cu_seqlens[1:].long() - 1].double()


@pytest.mark.parametrize(("config", "expected"), [
    (ModelRewardConfig(), lambda s: s),
    (ModelRewardConfig(normalize=ScoreNormalization.fixed, offset=0.1, scale=0.5),
     lambda s: (s - 0.1) / 0.5),
    (ModelRewardConfig(normalize=ScoreNormalization.fixed, offset=0.1, scale=0.5, clip=0.05),
     lambda s: ((s - 0.1) / 0.5).clamp(-0.05, 0.05)),
])
def test_the_reward_model_scores_each_sequence_at_its_last_token(config, expected):
    model = build_model(40, critic=True)
    scores = last_token_values(model, rollouts())
    result = ModelRewardInterface(config).inference(make_engine(model, None, lr=None), rollouts(),
                                                    MicroBatchSpec(max_tokens_per_microbatch=6))
    torch.testing.assert_close(result.data.data["rewards"], expected(scores).float())
    assert result.data.seqlens["rewards"] == [[1, 1], [1]]
    assert result.stats["score_mean"] == pytest.approx(scores.mean().item(), abs=1e-6)
    assert result.stats["reward_mean"] == pytest.approx(expected(scores).mean().item(), abs=1e-6)


RANK_SCORES = ([1.0, 2.0], [3.0, 4.0, 5.0, 6.0])
LATER_SCORES = ([0.0], [7.0])


def running_rewards(process_group, batches) -> list[list[float]]:
    interface = ModelRewardInterface(ModelRewardConfig(normalize=ScoreNormalization.running))
    return [interface.scores_to_rewards(torch.tensor(scores), process_group)[0].tolist()
            for scores in batches]


def _running_worker(rank: int, rendezvous: str, output: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{rendezvous}", rank=rank, world_size=2)
    try:
        group = dist.new_group([0, 1])
        rewards = running_rewards(group, [RANK_SCORES[rank], LATER_SCORES[rank]])
        Path(f"{output}.rank{rank}").write_text(json.dumps(rewards))
    finally:
        dist.destroy_process_group()


def test_running_normalisation_uses_every_score_so_far_on_every_rank(tmp_path):
    # Step 1 sees 1..6: mean 3.5, population variance 35/12. Step 2 adds 0 and 7: the eight
    # scores 0..7 have mean 3.5 and variance 63/12 = 5.25.
    std_1, std_2 = math.sqrt(35 / 12), math.sqrt(5.25)
    step_1 = [(score - 3.5) / std_1 for score in RANK_SCORES[0] + RANK_SCORES[1]]
    step_2 = [(0.0 - 3.5) / std_2, (7.0 - 3.5) / std_2]
    single = running_rewards(None, [RANK_SCORES[0] + RANK_SCORES[1], [0.0, 7.0]])
    assert single[0] == pytest.approx(step_1, abs=1e-6)
    assert single[1] == pytest.approx(step_2, abs=1e-6)

    output = str(tmp_path / "rewards")
    start_ranks(_running_worker, (str(tmp_path / "rendezvous"), output), 2)
    ranks = [json.loads(Path(f"{output}.rank{rank}").read_text()) for rank in range(2)]
    assert ranks[0][0] + ranks[1][0] == pytest.approx(step_1, abs=1e-6)  # rank 0 has 1, 2
    assert ranks[0][1] + ranks[1][1] == pytest.approx(step_2, abs=1e-6)  # rank 0 has 0


def test_running_normalisation_divides_by_at_least_a_tenth():
    # Scores that barely vary (std 0.005) are centred, not blown up: std is floored at 0.1.
    rewards = running_rewards(None, [[1.0, 1.01]])[0]
    assert rewards == pytest.approx([-0.05, 0.05], abs=1e-6)


def load_example_server():
    path = REPO_ROOT / "examples" / "reward_server.py"
    spec = importlib.util.spec_from_file_location("example_reward_server", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_remote_source_sends_prompts_responses_and_metadata_to_the_example_server(tokenizer):
    example = load_example_server()
    received = []

    class RecordingHandler(example.RewardHandler):
        def do_POST(self):  # noqa: N802
            body = self.rfile.read(int(self.headers["Content-Length"]))
            received.append(json.loads(body))
            self.answer(200, {"rewards": example.score_request(body)})

        def log_message(self, *args):
            pass

    server = example.ThreadingHTTPServer(("127.0.0.1", 0), RecordingHandler)
    thread = threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True)
    thread.start()
    try:
        samples = [("1+2=", ["3", "4"], "3"), ("9-5=", ["4"], "4")]
        tokens, prompt_mask, seqlens = [], [], []
        for prompt, responses, _ in samples:
            lengths = []
            for response in responses:
                ids = tokenizer.encode(prompt), tokenizer.encode(response) + [EOS_ID]
                tokens += ids[0] + ids[1]
                prompt_mask += [True] * len(ids[0]) + [False] * len(ids[1])
                lengths.append(len(ids[0]) + len(ids[1]))
            seqlens.append(lengths)
        data = SequenceSample.from_tensors(
            ids=["q0", "q1"], seqlens={"packed_input_ids": seqlens, "prompt_mask": seqlens},
            data={"packed_input_ids": torch.tensor(tokens), "prompt_mask": torch.tensor(prompt_mask)},
            metadata={"answer": [answer for *_, answer in samples], "task": ["math", "math"],
                      "solutions": [None, None]},
        )
        url = f"http://127.0.0.1:{server.server_address[1]}/score"
        interface = RemoteRewardInterface(RemoteRewardConfig(url=url, timeout_s=5.0))
        engine = TokenizerOnlyEngine(tokenizer, [EOS_ID])
        result = interface.inference(engine, data, MicroBatchSpec())
    finally:
        server.shutdown()
        server.server_close()
    assert result.data.data["rewards"].tolist() == [1.0, 0.0, 1.0]
    assert result.stats["reward_mean"] == pytest.approx(2 / 3) and result.stats["retries"] == 0
    (request,) = received
    assert request["items"] == [
        {"prompt": "1+2=", "response": "3", "metadata": {"query_id": "q0", "answer": "3", "task": "math"}},
        {"prompt": "1+2=", "response": "4", "metadata": {"query_id": "q0", "answer": "3", "task": "math"}},
        {"prompt": "9-5=", "response": "4", "metadata": {"query_id": "q1", "answer": "4", "task": "math"}},
    ]


def test_the_example_server_with_a_token_answers_only_requests_that_carry_it(monkeypatch):
    example = load_example_server()
    monkeypatch.setattr(example.RewardHandler, "token", "t0ken")
    monkeypatch.setattr(example.RewardHandler, "log_message", lambda *args: None)
    server = example.ThreadingHTTPServer(("127.0.0.1", 0), example.RewardHandler)
    thread = threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{server.server_address[1]}/score"
    items = [{"prompt": "1+2=", "response": "3", "metadata": {"answer": "3"}}]
    try:
        monkeypatch.setenv("REWARD_TOKEN_FOR_TEST", "t0ken")
        assert RemoteRewardClient(url, 5.0, 0, 0.0, token_env="REWARD_TOKEN_FOR_TEST").score(
            items) == [1.0]
        monkeypatch.setenv("REWARD_TOKEN_FOR_TEST", "guess")
        for token_env in ("REWARD_TOKEN_FOR_TEST", ""):
            with pytest.raises(RemoteRewardError, match="HTTP 401"):
                RemoteRewardClient(url, 5.0, 0, 0.0, token_env=token_env).score(items)
    finally:
        server.shutdown()
        server.server_close()
