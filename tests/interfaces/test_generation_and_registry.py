import json

import pytest
from conftest import build_model, make_engine, prompt_batch

from realrl.api.dfg import MicroBatchSpec
from realrl.api.rl_config import GenerationHyperparameters
from realrl.backends.torch_engine import ParallelContext
from realrl.interfaces.configs import INTERFACE_CONFIGS, DPOConfig, GenerationConfig, SFTConfig
from realrl.interfaces.generation import GenerationInterface
from realrl.interfaces.registry import INTERFACES, make_interface


def test_generation_appends_one_json_line_per_completion_to_the_rank_file(
    tokenizer, tmp_path, monkeypatch
):
    monkeypatch.setenv("REALRL_RUN_DIR", str(tmp_path))
    engine = make_engine(
        build_model(len(tokenizer)),
        tokenizer,
        lr=None,
        parallel=ParallelContext(dp_rank=1, dp_size=2),
    )
    config = GenerationConfig(
        generation=GenerationHyperparameters(max_new_tokens=5),
        n_samples=2,
        output_file="samples.jsonl",
    )
    interface = GenerationInterface(config)
    prompts = prompt_batch(tokenizer, ["1+2=", "33*4="])
    result = interface.generate(engine, prompts, MicroBatchSpec())
    interface.generate(engine, prompts, MicroBatchSpec())
    assert result.data is None and result.stats["completions_written"] == 4
    lines = (tmp_path / "samples.rank1.jsonl").read_text().splitlines()
    records = [json.loads(line) for line in lines]
    assert len(records) == 8  # 2 calls x 2 prompts x 2 samples, appended
    assert [r["query_id"] for r in records[:4]] == ["q0", "q0", "q1", "q1"]
    assert [r["prompt"] for r in records[:4]] == ["1+2=", "1+2=", "33*4=", "33*4="]
    for record in records:
        assert set(record) == {"query_id", "prompt", "completion", "no_eos"}
        assert "<eos>" not in record["completion"]
        assert len(record["completion"]) <= 5  # one character per token, EOS dropped


def test_generation_without_a_run_directory_says_how_to_fix_it(tokenizer, monkeypatch):
    monkeypatch.delenv("REALRL_RUN_DIR", raising=False)
    engine = make_engine(build_model(len(tokenizer)), tokenizer, lr=None)
    with pytest.raises(RuntimeError, match="REALRL_RUN_DIR"):
        GenerationInterface(GenerationConfig()).generate(
            engine, prompt_batch(tokenizer, ["1+2="]), MicroBatchSpec()
        )


def test_registry_builds_every_configured_interface_from_its_config():
    assert set(INTERFACES) == set(INTERFACE_CONFIGS)
    for name, config_type in INTERFACE_CONFIGS.items():
        interface = make_interface(name, config_type())
        assert isinstance(interface, INTERFACES[name])
        assert interface.optimizer_steps_per_call() >= 0
        for method in ("generate", "inference", "train_step"):
            assert callable(getattr(interface, method))


def test_registry_lists_valid_names_and_rejects_a_wrong_config_type():
    with pytest.raises(ValueError, match="valid: .*ppo_actor.*rule_reward"):
        make_interface("ppo_actorr", None)
    with pytest.raises(TypeError, match="takes a DPOConfig"):
        make_interface("dpo", SFTConfig())
    assert make_interface("dpo", DPOConfig(beta=0.2)).config.beta == 0.2


def test_unsupported_calls_name_the_interface_and_what_it_supports():
    with pytest.raises(NotImplementedError, match="'dpo' has no generate.*supports train_step"):
        make_interface("dpo").generate(None, None, MicroBatchSpec())
