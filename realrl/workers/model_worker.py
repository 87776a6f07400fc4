"""A model worker: hosts model shards and runs the MFC requests the master sends it.

Start-up, in order: join the rendezvous store, read the run plan from it, join the
torch.distributed world (gloo on CPU, NCCL on GPU; with the plan's collective timeout), bind a
ZeroMQ server and publish its address in the store, start the heartbeat thread that the
master's hang watchdog pings (`realrl.workers.heartbeat`), create every process group of the
plan (all ranks, same order), and build the model shards of the layouts this rank belongs to.
Then serve requests one at a time: the master's per-rank locks guarantee that collectives are
entered in the same order on every rank.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from realrl.api import environment
from realrl.api.config import NanPolicy
from realrl.api.data import SequenceSample
from realrl.api.dfg import MFCDef, MFCKind, OffloadHook
from realrl.api.errors import UserFacingError
from realrl.api.experiment import ModelKind
from realrl.backends.torch_engine import NonFiniteError, ParallelContext, TorchEngine
from realrl.backends.worker_device import worker_device, world_backend
from realrl.interfaces.chunked_generation import ChunkRequest
from realrl.interfaces.registry import make_interface
from realrl.models.checkpoint import checkpoint_eos_token_ids
from realrl.models.tokenizer import load_tokenizer
from realrl.workers import checkpointing
from realrl.workers.checkpoint_disk import out_of_space, write_failure_reason
from realrl.workers.core_share import CoreShare
from realrl.workers.heap_freeze import HeapFreezer
from realrl.workers.heartbeat import HeartbeatResponder, heartbeat_key, install_stack_dump_signal
from realrl.workers.malloc import retain_freed_memory
from realrl.workers.memory_watch import MemoryWatch
from realrl.workers.realloc import (
    ProcessGroups,
    collective_timeout,
    share_replica_weights,
    transfer_parameters,
)
from realrl.workers.rendezvous import Rendezvous
from realrl.workers.run_plan import LayoutKey, RunPlan
from realrl.workers.run_secret import load_run_secret
from realrl.workers.transport import Server
from realrl.workers.wire import Message

logger = logging.getLogger(__name__)


@dataclass
class TokenizerOnlyEngine:
    """What a rule-based role (a verifier, no weights) gets: the policy's tokenizer and the EOS
    ids its checkpoint declares (config.json and generation_config.json)."""

    tokenizer: object
    eos_token_ids: list[int]
    module: None = None


@dataclass
class HostedModel:
    layout: LayoutKey
    engine: TorchEngine


class ModelWorker:
    def __init__(self, rank: int, plan: RunPlan, groups: ProcessGroups,
                 cores: CoreShare | None = None):
        self.rank = rank
        self.plan = plan
        self.groups = groups
        self.cores = cores
        self.models: dict[LayoutKey, HostedModel] = {}
        self.interfaces = {}
        self.rule_engines: dict[str, TokenizerOnlyEngine] = {}
        # Broadcasts this rank started as a sender and returned before they finished (a
        # transfer with `post_send`); waited for before any request but an MFC.
        self.pending_sends: list[dist.Work] = []
        self._build()
        device = worker_device()
        # Each call's peak memory, and a hint when it nears this worker's share.
        limit_gb = plan.base.worker_memory_gb
        self.memory = MemoryWatch(device, plan.base.n_devices_per_node,
                                  limit_bytes=None if limit_gb is None else int(limit_gb * 2**30))

    def _build(self) -> None:
        from realrl.workers.model_loading import base_donor, load_engine

        for layout in self.plan.layouts_in_build_order():
            if self.rank not in layout.ranks:
                continue
            allocation = self.plan.allocation_of_layout(layout)
            coords = allocation.coordinates_of(self.rank)
            parallel = ParallelContext(
                dp_rank=coords.dp, dp_size=allocation.strategy.data,
                dp_group=self.groups.data_group(layout, self.rank),
                tp_rank=coords.tp, tp_size=allocation.strategy.tensor,
                tp_group=self.groups.tensor_group(layout, self.rank),
                layout_group=self.groups.layout_group(layout),
            )
            spec = self.plan.models[layout.role]
            trains = spec.trainable and layout == self.plan.owner_layout(layout.role)
            steps_per_call = max(
                (self._interface(m).optimizer_steps_per_call() for m in self.plan.mfcs
                 if m.is_train and m.model_role == layout.role), default=1)
            # The replica's tp-0 rank names the sampling seed: tp ranks must sample alike.
            replica_rank = allocation.rank_at(coords.dp, coords.pp, 0)
            engine = load_engine(spec, parallel, trains=trains,
                                 total_optimizer_steps=self.plan.base.total_train_steps * steps_per_call,
                                 seed=self.plan.base.seed * 1000 + replica_rank,
                                 adapter_seed=self.plan.base.seed,
                                 donor=base_donor(spec, parallel, self.models))
            engine.nan_policy = self.plan.base.nan_policy
            # A bf16 EMA target blends into fp32 masters of its own (`TorchEngine.ema_master`).
            ema_target = (layout == self.plan.owner_layout(layout.role)
                          and layout.role in {hook.target_role for _, hook in self.plan.ema_hooks()}
                          and engine.module.dtype != torch.float32)
            shared = share_replica_weights(engine, layout, private=trains or ema_target)
            if cores := self.cores:
                cores.attach(engine.module)
            self.models[layout] = HostedModel(layout, engine)
            kind = "trainable" if trains else "frozen, one shared copy" if shared else "frozen"
            logger.info("hosting %s (%s, dp %d/%d, tp %d/%d)", layout, kind, coords.dp,
                        allocation.strategy.data, coords.tp, allocation.strategy.tensor)

    def _interface(self, mfc: MFCDef):
        if mfc.name not in self.interfaces:
            self.interfaces[mfc.name] = make_interface(mfc.interface, mfc.interface_config)
        return self.interfaces[mfc.name]

    def _engine_for(self, mfc: MFCDef):
        """The model shard of the MFC's layout; a tokenizer-only engine for rule-based roles."""
        spec = self.plan.models[mfc.model_role]
        if spec.kind == ModelKind.rule:
            if mfc.model_role not in self.rule_engines:
                self.rule_engines[mfc.model_role] = TokenizerOnlyEngine(
                    load_tokenizer(spec.config.path), checkpoint_eos_token_ids(spec.config.path))
            return self.rule_engines[mfc.model_role]
        engine = self.models[self.plan.layout_of(mfc.name)].engine
        engine.onload()
        return engine

    # ------------------------------------------------------------------ handlers

    def handle(self, message: Message) -> Message:
        partners = (self.plan.allocations[message.header["mfc"]].mesh.ranks
                    if message.kind == "mfc" else ())
        with self.cores.busy(partners) if self.cores else contextlib.nullcontext():
            if message.kind != "mfc":
                self.finish_sends()
            return self._handle(message)

    def finish_sends(self) -> None:
        """Wait for the broadcasts still in flight (their buffer is reused by the next one)."""
        while self.pending_sends:
            self.pending_sends.pop(0).wait()

    def close_generators(self) -> None:
        """Stop the vLLM engines (`gen.backend=vllm`) of the hosted models: each runs its engine
        core in a child process of this worker, and keeps its config in a temporary directory."""
        for hosted in self.models.values():
            if hosted.engine.vllm_generator is not None:
                hosted.engine.vllm_generator.close()
                hosted.engine.vllm_generator = None

    def _handle(self, message: Message) -> Message:
        handler = {
            "mfc": self._run_mfc,
            "transfer": self._transfer,
            "save": self._save,
            "load": self._load,
        }.get(message.kind)
        if handler is None:
            return message.error_reply(f"unknown request kind {message.kind!r}")
        return handler(message)

    def _run_mfc(self, message: Message) -> Message:
        mfc = next(m for m in self.plan.mfcs if m.name == message.header["mfc"])
        data = None  # a chunk of a running generation after its first has none
        if "data" in message.header:
            data = SequenceSample.from_wire(message.header["data"], message.tensors)
            remap = {key: name for key, name in mfc.input_key_remap.items() if key in data.keys}
            data = data.rename(remap) if remap else data  # a forward ahead: forward_keys only
        interface = self._interface(mfc)
        engine = self._engine_for(mfc)
        method = {MFCKind.generate: interface.generate, MFCKind.inference: interface.inference,
                  MFCKind.train_step: interface.train_step}[mfc.kind]
        if message.header.get("ahead"):
            method = interface.train_forward  # the train call's forward (MFCDef.forward_keys)
        if "chunk" in message.header:  # interruptible generation (rollout.mode=async)
            method = functools.partial(interface.generate_chunk,
                                       request=ChunkRequest(**message.header["chunk"]))
        torch_engine = engine if isinstance(engine, TorchEngine) else None
        self.memory.start(torch_engine)
        started = time.perf_counter()
        skipped_before = torch_engine.skipped_steps if torch_engine else 0
        where = (f"step {message.header.get('step', '?')}, MFC {mfc.name}, role "
                 f"{mfc.model_role}, rank {self.rank}")
        try:
            result = method(engine, data, mfc.microbatch)
        except UserFacingError as error:  # a NaN under nan_policy=stop, a reward service down
            error.add_context(where)
            raise
        compute_s = time.perf_counter() - started
        if result is None:  # a chunk of a generation that goes on (`generate_chunk`)
            peak_gb = self.memory.stop(mfc.name, True, torch_engine)
            return message.reply({"stats": {}, "compute_s": compute_s, "peak_memory_gb": peak_gb,
                                  "chunk_done": False})
        if mfc.kind == MFCKind.train_step and torch_engine is not None:
            result.stats["skipped_steps"] = torch_engine.skipped_steps - skipped_before
        self._check_outputs(result.data, where)
        peak_gb = self.memory.stop(mfc.name, mfc.kind == MFCKind.generate, torch_engine)
        if any(isinstance(hook, OffloadHook) for hook in mfc.post_hooks):
            engine.offload()
        header = {"stats": result.stats, "compute_s": compute_s, "peak_memory_gb": peak_gb,
                  "chunk_done": True}
        if result.data is None or self.rank not in self.plan.allocations[mfc.name].dp_head_ranks():
            return message.reply(header)
        output = result.data.rename(mfc.output_key_remap) if mfc.output_key_remap else result.data
        meta, tensors = output.to_wire()
        return message.reply(header | {"data": meta}, tensors)

    def _check_outputs(self, data: SequenceSample | None, where: str) -> None:
        """A NaN or inf in an MFC's output (rewards, values, log-probs) is reported where it
        appears: `nan_policy=stop` raises, `skip` warns (training on it then skips its step)."""
        for key, tensor in (data.data.items() if data is not None else ()):
            if not torch.is_floating_point(tensor):
                continue
            bad = (~torch.isfinite(tensor)).nonzero().flatten()
            if bad.numel() == 0:
                continue
            problem = (f"{where}: output `{key}` holds {bad.numel()} NaN or inf value(s) of "
                       f"{tensor.numel()} (first at index {int(bad[0])})")
            if self.plan.base.nan_policy != NanPolicy.skip:
                raise NonFiniteError(f"{problem}; nan_policy=stop")
            logger.warning("%s; nan_policy=skip: training on it skips its optimizer step", problem)

    def _transfer(self, message: Message) -> Message:
        source = LayoutKey(**_layout_fields(message.header["source"]))
        target = LayoutKey(**_layout_fields(message.header["target"]))
        started = time.perf_counter()
        for layout in (source, target):
            if layout in self.models:
                self.models[layout].engine.onload()
        sends_alone = transfer_parameters(
            source_engine=self.models[source].engine if source in self.models else None,
            target_engine=self.models[target].engine if target in self.models else None,
            source=source, target=target, rank=self.rank, eta=message.header["eta"],
            groups=self.groups, plan=self.plan,
            pending=self.pending_sends if message.header.get("post_send") else None,
            split=message.header.get("split", False),
        )
        if target in self.models:
            self.models[target].engine.weights_received += 1
        reply = {"compute_s": time.perf_counter() - started}
        if sends_alone is not None:  # the sender's: whether the master may split its refreshes
            reply["sends_alone"] = sends_alone
        return message.reply(reply)

    def _save(self, message: Message) -> Message:
        for hosted in self.models.values():
            hosted.engine.onload()
        directory = Path(message.header["directory"])
        try:
            checkpointing.save_worker_state(self, str(directory))
        except Exception as error:  # torch.save reports a full disk as a RuntimeError
            if not out_of_space(error, directory):
                raise
            reason = write_failure_reason(error, directory)
            logger.error("cannot write this worker's checkpoint files: %s", reason)
            return message.error_reply(f"worker {self.rank}: {reason}")
        return message.reply({})

    def _load(self, message: Message) -> Message:
        for hosted in self.models.values():
            hosted.engine.onload()
        checkpointing.load_worker_state(self, message.header["directory"])
        for hosted in self.models.values():
            hosted.engine.weights_received += 1
        return message.reply({})


def _layout_fields(data: dict) -> dict:
    return {"role": data["role"], "ranks": tuple(data["ranks"]), "strategy": data["strategy"]}


def join_world(store: dist.Store, rank: int, world_size: int, plan: RunPlan) -> None:
    """Join the torch.distributed world of every model worker: NCCL on GPU, gloo on CPU, with
    the plan's collective timeout (`realrl.workers.realloc.collective_timeout`)."""
    dist.init_process_group(world_backend(), store=store, rank=rank, world_size=world_size,
                            timeout=collective_timeout(plan))


def serve(rendezvous: Rendezvous, rank: int, world_size: int) -> None:
    """Run one model worker until the master says `exit` (or the supervisor stops us)."""
    retain_freed_memory()
    install_stack_dump_signal()
    secret = load_run_secret(os.environ.get(environment.RUN_DIR))
    plan = RunPlan.from_json(rendezvous.wait_for("plan"))  # the master publishes it first
    join_world(rendezvous.torch_store("dist"), rank, world_size, plan)
    server = Server(f"tcp://{rendezvous.advertised_host}:*", secret)
    rendezvous.publish(f"worker/{rank}/address", server.bound_address)
    heartbeat = HeartbeatResponder(rendezvous.advertised_host, secret)
    rendezvous.publish(heartbeat_key(rank), heartbeat.publication())
    groups = ProcessGroups.create(plan)
    cores = CoreShare.from_environment()
    worker = ModelWorker(rank, plan, groups, cores)
    rendezvous.publish(f"worker/{rank}/ready", "1")
    logger.info("worker %d ready at %s", rank, server.bound_address)
    heap = HeapFreezer()
    mfcs_run: set[tuple[str | None, bool]] = set()
    try:
        while True:
            received = server.recv(timeout_s=None)
            if received is None:
                continue
            peer, message = received
            if message.kind == "exit":
                worker.finish_sends()
                server.send(peer, message.reply({}))
                break
            try:
                reply = worker.handle(message)
            except Exception as exc:  # a UserFacingError's traceback goes to the log file only
                logger.error("request %s failed: %s", message.kind, exc, exc_info=exc)
                reply = message.error_reply(f"worker {rank}: {type(exc).__name__}: {exc}",
                                            user_facing=isinstance(exc, UserFacingError))
            server.send(peer, reply)
            call = (message.header.get("mfc"), bool(message.header.get("ahead")))
            first_run = message.kind == "mfc" and call not in mfcs_run
            if first_run:
                mfcs_run.add(call)
            heap.between_requests(warmed_up=first_run)
    finally:
        worker.close_generators()
        heap.close()
        heartbeat.close()
        server.close()
        if cores is not None:
            cores.close()
        dist.destroy_process_group()
