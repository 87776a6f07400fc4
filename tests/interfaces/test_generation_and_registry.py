import pytest
from interface_helpers import build_model, make_engine, prompt_batch

from realrl.api.dfg import MicroBatchSpec
from realrl.api.rl_config import GenerationHyperparameters
from realrl.backends.torch_engine import ParallelContext
from realrl.interfaces.common import sampling_config
from realrl.interfaces.configs import INTERFACE_CONFIGS, DPOConfig, GenerationConfig, SFTConfig
from realrl.interfaces.generation import GenerationInterface
from realrl.interfaces.registry import INTERFACES, make_interface


def test_generation_returns_every_completion_to_the_master_as_a_rollout(tokenizer):
    engine = make_engine(
        build_model(len(tokenizer)),
        tokenizer,
        lr=None,
        parallel=ParallelContext(dp_rank=1, dp_size=2),
    )
    config = GenerationConfig(generation=GenerationHyperparameters(max_new_tokens=5), n_samples=2)
    prompts = prompt_batch(tokenizer, ["1+2=", "33*4="], metadata={"answer": ["3", "132"]})
    data = GenerationInterface(config).generate(engine, prompts, MicroBatchSpec()).data

    assert data.ids == ["q0", "q1"] and data.metadata == {"answer": ["3", "132"]}
    assert data.keys == {"packed_input_ids", "prompt_mask", "seq_no_eos_mask"}
    assert [len(lengths) for lengths in data.seqlens["packed_input_ids"]] == [2, 2]
    sequences = data.data["packed_input_ids"].split(data.seqlens_of("packed_input_ids"))
    masks = data.data["prompt_mask"].split(data.seqlens_of("prompt_mask"))
    no_eos = data.data["seq_no_eos_mask"].tolist()
    for index, (tokens, in_prompt) in enumerate(zip(sequences, masks)):
        prompt = tokenizer.encode(["1+2=", "33*4="][index // 2], add_special_tokens=True)
        assert tokens[: len(prompt)].tolist() == prompt  # the prompt, then the completion
        assert in_prompt.tolist() == [True] * len(prompt) + [False] * (len(tokens) - len(prompt))
        response = tokens[len(prompt):].tolist()
        assert 1 <= len(response) <= 5
        assert (response[-1] == tokenizer.eos_token_id) == (not no_eos[index])


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


def test_sampling_config_carries_the_decode_step_keys(tokenizer):
    engine = make_engine(build_model(len(tokenizer)), tokenizer, lr=None)
    hyperparameters = GenerationHyperparameters(compile=True, cuda_graphs=False)
    config = sampling_config(hyperparameters, 2, engine)
    assert (config.n, config.compile, config.cuda_graphs) == (2, True, False)
