"""Idle workers lend their CPU threads to busy ones (`realrl.workers.core_share`)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import realrl.experiments  # noqa: F401  (registers ppo-math)
from realrl.api import config as api_config
from realrl.api import environment
from realrl.api.config import resolve_config
from realrl.api.registry import get_experiment
from realrl.launcher.plan import build_plan
from realrl.launcher.prepare import write_run_files
from realrl.models.compiled import enable_compiled_blocks
from realrl.models.config import ModelConfig
from realrl.models.generation import generate
from realrl.models.sampling import GenerationConfig
from realrl.models.transformer import Transformer
from realrl.workers import core_share
from realrl.workers.core_share import (
    SLOT_BYTES,
    CoreShare,
    CoreShareSpec,
    create_share_file,
    unlink_mapped_share_file,
)
from realrl.workers.model_worker import ModelWorker
from realrl.workers.wire import Message


@pytest.fixture
def restore_threads():
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


def _share(tmp_path, slot: int, slots: int = 3, threads: int = 1,
           lend_after_s: float = 0.0) -> CoreShare:
    """A worker's view of a file in `tmp_path`; peers lend the moment they stop, unless
    `lend_after_s` says otherwise."""
    path = tmp_path / "core-share"
    if not path.exists():
        path.write_bytes(bytes(slots * SLOT_BYTES))
    return CoreShare(CoreShareSpec(path, slot, slots, threads), lend_after_s)


def test_the_launcher_file_starts_all_idle_in_shared_memory():
    path = create_share_file(3)
    try:
        assert path.read_bytes() == bytes(3 * SLOT_BYTES)
        if os.access("/dev/shm", os.W_OK):
            assert path.parent == Path("/dev/shm")
    finally:
        path.unlink()


def test_spec_round_trips_through_the_environment_value(tmp_path):
    spec = CoreShareSpec(tmp_path / "a:b" / "core-share", 2, 4, 3)
    assert CoreShareSpec.from_env(spec.to_env()) == spec


def test_a_busy_worker_takes_the_threads_of_idle_peers_and_gives_them_back(
    tmp_path, restore_threads
):
    first, second, third = (_share(tmp_path, slot, threads=2) for slot in range(3))
    torch.set_num_threads(2)
    with first.busy():
        assert torch.get_num_threads() == 6  # both peers idle
        with second.busy():
            first.rebalance()
            assert torch.get_num_threads() == 4
            with third.busy():
                first.rebalance()
                assert torch.get_num_threads() == 2
        first.rebalance()
        assert torch.get_num_threads() == 6
    assert torch.get_num_threads() == 2
    first.rebalance()  # idle: a layer hook outside a request changes nothing
    assert torch.get_num_threads() == 2


def test_a_worker_does_not_take_the_threads_of_its_own_calls_mesh(tmp_path, restore_threads):
    first, second, third = (_share(tmp_path, slot, threads=2) for slot in range(3))
    torch.set_num_threads(2)
    # A data-parallel call on slots 0 and 1: slot 1 has not flagged itself busy yet, but it is
    # about to serve the same request, so only idle slot 2 lends its threads.
    with first.busy(partners=(0, 1)):
        assert torch.get_num_threads() == 4
        with second.busy(partners=(0, 1)):
            first.rebalance()
            assert torch.get_num_threads() == 4
        with third.busy():
            first.rebalance()
            assert torch.get_num_threads() == 2
    # The next call is this worker's alone: every idle peer lends again.
    with first.busy(partners=(0,)):
        assert torch.get_num_threads() == 6


def test_a_peer_lends_only_once_it_has_been_idle_for_a_while(
    tmp_path, restore_threads, monkeypatch
):
    # A streaming generator stops and starts again every few milliseconds between chunks:
    # its core is not taken in those gaps, only once it has been idle for `lend_after_s`.
    now = [10**12]  # ns, one clock for both views (CLOCK_MONOTONIC is machine-wide)
    monkeypatch.setattr(core_share.time, "monotonic_ns", lambda: now[0])
    trainer = _share(tmp_path, 0, slots=2, lend_after_s=0.02)
    generator = _share(tmp_path, 1, slots=2, lend_after_s=0.02)
    torch.set_num_threads(1)
    with trainer.busy():
        assert torch.get_num_threads() == 2  # idle since the launch: lent at once
        with generator.busy():
            trainer.rebalance()
            assert torch.get_num_threads() == 1
        now[0] += 19_000_000  # 19 ms after the generator's chunk: still its core
        trainer.rebalance()
        assert torch.get_num_threads() == 1
        with generator.busy():  # the next chunk
            now[0] += 5_000_000
        now[0] += 20_000_000
        trainer.rebalance()
        assert torch.get_num_threads() == 2  # idle for 20 ms: lent
        with generator.busy():
            trainer.rebalance()
            assert torch.get_num_threads() == 1  # taken back at once, no grace that way
    assert torch.get_num_threads() == 1


@pytest.fixture
def restore_recompile_limit():
    limit = torch._dynamo.config.recompile_limit
    yield
    torch._dynamo.config.recompile_limit = limit


def test_compiled_code_keeps_a_graph_for_every_thread_count_a_worker_can_run_at(
    tmp_path, restore_threads, restore_recompile_limit
):
    # Dynamo guards compiled code on the thread count, so a worker that runs at `slots`
    # counts needs room for that many variants of each function beyond dynamo's default 8.
    torch._dynamo.config.recompile_limit = 8
    share = _share(tmp_path, 0, slots=5)
    assert torch._dynamo.config.recompile_limit == 40
    compiles = []

    def counting_backend(graph, example_inputs):
        compiles.append(torch.get_num_threads())
        return graph.forward

    torch._dynamo.reset()
    double = torch.compile(lambda x: x * 2, backend=counting_backend)
    x = torch.ones(3)
    counts = [1, 2, 3, 4, 5] * 2
    for threads in counts:
        for grad in (True, False):  # grad mode is guarded too: 10 variants in all
            torch.set_num_threads(threads)
            with torch.set_grad_enabled(grad):
                assert torch.equal(double(x), x * 2)
    assert sorted(compiles) == sorted(counts[:5] * 2)  # compiled once each, none run eagerly
    share.close()
    torch._dynamo.reset()


def test_the_flags_are_shared_between_processes(tmp_path, restore_threads, monkeypatch):
    """A peer in another process going busy takes its threads back from this one, also after
    the master removed the file that both had mapped."""
    child = textwrap.dedent(f"""
        import sys, time
        from pathlib import Path
        from realrl.workers.core_share import CoreShare, CoreShareSpec
        share = CoreShare(CoreShareSpec(Path({str(tmp_path / "core-share")!r}), 1, 2, 1))
        with share.busy():
            print("busy", flush=True)
            sys.stdin.readline()
        print("idle", flush=True)
        sys.stdin.readline()
    """)
    share = _share(tmp_path, 0, slots=2)
    peer = subprocess.Popen([sys.executable, "-c", child], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)
    try:
        with share.busy():
            assert peer.stdout.readline().strip() == "busy"
            monkeypatch.setenv(environment.CORE_SHARE_FILE, str(tmp_path / "core-share"))
            unlink_mapped_share_file()
            assert not (tmp_path / "core-share").exists()
            share.rebalance()
            assert torch.get_num_threads() == 1
            peer.stdin.write("\n")
            peer.stdin.flush()
            assert peer.stdout.readline().strip() == "idle"
            share.rebalance()
            assert torch.get_num_threads() == 2
        peer.stdin.write("\n")
        peer.stdin.flush()
        assert peer.wait(timeout=30) == 0
    finally:
        peer.kill()


def _tiny_model() -> tuple[Transformer, list[str]]:
    config = ModelConfig(vocab_size=32, hidden_size=16, intermediate_size=32,
                         num_hidden_layers=3, num_attention_heads=2, num_key_value_heads=1)
    model = Transformer(config)
    calls: list[str] = []
    model.between_layers = lambda: calls.append("between")
    return model, calls


def test_the_model_calls_back_between_layers_in_forward_and_backward():
    model, calls = _tiny_model()
    ids = torch.randint(0, 32, (10,))
    cu_seqlens = torch.tensor([0, 4, 10])
    with torch.no_grad():
        model(ids, cu_seqlens)
    assert len(calls) == 3
    calls.clear()
    logits = model(ids, cu_seqlens)
    assert len(calls) == 3
    logits.sum().backward()
    assert len(calls) == 6


def test_attaching_a_model_hooks_its_layers_and_covers_every_thread_count(tmp_path):
    share = _share(tmp_path, 0, slots=3, threads=2)
    eager, _ = _tiny_model()
    share.attach(eager)
    assert eager.between_layers == share.rebalance
    compiled, _ = _tiny_model()
    enable_compiled_blocks(compiled, "actor.compile")
    share.attach(compiled)
    assert compiled.between_layers == share.rebalance
    assert compiled.compiled_blocks.thread_counts == (2, 4, 6)  # own share + 0, 1 or 2 lent
    share.close()


def test_decode_steps_do_not_call_back():
    """Only the prefill goes through the layer hook: decode keeps its own thread rule."""
    model, calls = _tiny_model()
    config = GenerationConfig(max_new_tokens=5, min_new_tokens=5, n=2)
    generate(model, torch.randint(0, 32, (7,)), torch.tensor([0, 3, 7]), config,
             torch.Generator().manual_seed(0))
    assert len(calls) == 3


def test_a_model_worker_lends_across_calls_but_not_within_a_calls_mesh(
    tmp_path, restore_threads, monkeypatch
):
    # The real plan `ppo-math` gets on two CPU workers: generation data parallel over both,
    # the actor's training on worker 0 and the critic's on worker 1.
    monkeypatch.setattr(api_config, "may_have_gpus", lambda: False)
    config = resolve_config(get_experiment("ppo-math").config_class,
                            [f"output_root={tmp_path}", "n_devices_per_node=2"])
    launch_plan = build_plan(config)
    launch_plan.run_dir.mkdir(parents=True)
    worker = ModelWorker.__new__(ModelWorker)  # no model shards: only the request path
    worker.plan, worker.pending_sends = write_run_files(config, launch_plan), []
    worker.cores = _share(tmp_path, slot=0, slots=2)
    threads_seen = []
    monkeypatch.setattr(worker, "_handle",
                        lambda message: threads_seen.append(torch.get_num_threads()))
    torch.set_num_threads(1)
    for name in ("actor_gen", "actor_train"):  # worker 1 idle in both
        worker.handle(Message("mfc", {"mfc": name}))
    assert threads_seen == [1, 2]


def test_dynamo_is_imported_by_whoever_compiles_and_its_limit_raised_before_threads_change(
    tmp_path
):
    # Importing torch._dynamo costs 1.5 s of CPU: a worker that compiles nothing never does.
    path = tmp_path / "core-share"
    path.write_bytes(bytes(2 * SLOT_BYTES))
    script = textwrap.dedent(f"""
        import sys
        from pathlib import Path
        from realrl.workers.core_share import CoreShare, CoreShareSpec
        share = CoreShare(CoreShareSpec(Path({str(path)!r}), 0, 2, 1))
        with share.busy():
            pass
        print("torch._dynamo" in sys.modules)
        import torch._dynamo
        torch._dynamo.config.recompile_limit = 8
        with share.busy():
            pass
        print(torch._dynamo.config.recompile_limit)
    """)
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["False", "16"]
