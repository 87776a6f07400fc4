"""The offload hook: a frozen model's weights leave the device after its MFC and come back
before the next use. On a CPU engine nothing is moved (there is no device memory to free)."""

import pytest
import torch

from realrl.api.experiment import OptimizerConfig
from realrl.backends.torch_engine import ParallelContext, TorchEngine
from realrl.launcher.defaults import fresh_default_model
from realrl.models.checkpoint import load_pretrained


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    return fresh_default_model(tmp_path_factory.mktemp("offload") / "model")


def test_offload_refuses_a_model_with_an_optimizer(model_path):
    engine = TorchEngine(load_pretrained(model_path), None, ParallelContext(),
                         OptimizerConfig(lr=1e-3))
    with pytest.raises(RuntimeError, match="only frozen models"):
        engine.offload()


def test_offload_on_cpu_keeps_weights_in_place_and_results_unchanged(model_path):
    engine = TorchEngine(load_pretrained(model_path), None, ParallelContext())
    ids, cu = torch.tensor([3, 4, 5, 6]), torch.tensor([0, 4], dtype=torch.int32)
    before = engine.module(ids, cu)
    engine.offload()
    assert not engine.offloaded and engine.device.type == "cpu"
    engine.onload()
    assert torch.equal(engine.module(ids, cu), before)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_offload_moves_weights_to_host_and_back_on_gpu(model_path):
    engine = TorchEngine(load_pretrained(model_path, device="cuda"), None, ParallelContext())
    ids = torch.tensor([3, 4, 5, 6], device="cuda")
    cu = torch.tensor([0, 4], dtype=torch.int32, device="cuda")
    before = engine.module(ids, cu)
    engine.offload()
    assert engine.offloaded and engine.device.type == "cpu"
    engine.onload()
    assert engine.device.type == "cuda" and torch.equal(engine.module(ids, cu), before)


def test_a_train_step_and_an_offload_free_the_captured_decode_graphs(model_path):
    """Captured decode graphs hold their KV caches between `generate` calls (CUDA only); a
    train step on the same module frees them first, and so does an offload."""
    trained = TorchEngine(load_pretrained(model_path), None, ParallelContext(),
                          OptimizerConfig(lr=1e-3))
    ids, cu = torch.tensor([3, 4, 5, 6]), torch.tensor([0, 4], dtype=torch.int32)
    trained.module.decode_graphs = object()  # what `generate` leaves with gen.cuda_graphs

    def loss_fn(forward, _):
        return forward(ids, cu).square().mean(), {}

    trained.train_microbatches([None], loss_fn)
    assert trained.module.decode_graphs is None

    frozen = TorchEngine(load_pretrained(model_path), None, ParallelContext())
    frozen.module.decode_graphs = object()
    frozen.offload()
    assert frozen.module.decode_graphs is None
