"""What the launcher asks the SLURM cluster before submitting (issue 26 item 6): GPU GRES
detection for `slurm.gpu_request=auto`, and `sbatch --test-only` with a fix line.

The parsing tests need no cluster; the CLI tests skip where no cluster answers `sinfo`
(`tools/slurm-local.sh up` makes one on localhost, CPU-only unless SLURM_LOCAL_GPUS is set).
"""

import subprocess
import sys

import pytest
from test_slurm_cluster import _slurm_reachable

from realrl.launcher.slurm_checks import lists_gpu_gres, sbatch_fix
from realrl.launcher.warm_start import PACKAGED_ACTOR


@pytest.mark.parametrize(("output", "has_gpus"), [
    ("(null)\n", False),
    ("(null)\ngpu:8\n", True),
    ("gpu:a100:4(S:0-1)\n", True),
    ("shard:8,gpu:2\n", True),
    ("gpu\n", True),
    ("gpumem:0\n", False),  # a GRES whose name merely starts with "gpu"
    ("", False),
])
def test_sinfo_gres_lists_gpus_only_for_a_gpu_gres(output, has_gpus):
    assert lists_gpu_gres(output) == has_gpus


def test_sbatch_errors_get_the_fix_for_their_cause():
    # sbatch's own words (slurm 22.05).
    assert "slurm.gpu_request=none" in sbatch_fix(
        "sbatch: error: Invalid generic resource (gres) specification")
    assert "slurm.partition" in sbatch_fix(
        "sbatch: error: invalid partition specified: gpu allocation failure: Invalid partition "
        "name specified")
    assert "n_devices_per_node" in sbatch_fix(
        "allocation failure: Requested node configuration is not available")
    assert "scontrol ping" in sbatch_fix(
        "allocation failure: Unable to contact slurm controller (connect failure)")
    assert "docs/slurm.md" in sbatch_fix("sbatch: error: something new")


def _dry_run(tmp_path, *overrides):
    return subprocess.run(
        [sys.executable, "-m", "realrl.apps.quickstart", "sft", "--dry-run", "mode=slurm",
         "wandb.mode=disabled", "tensorboard=false", f"model.path={PACKAGED_ACTOR}",
         f"output_root={tmp_path}", *overrides], capture_output=True, text=True, timeout=120)


@pytest.mark.slurm
@pytest.mark.skipif(not _slurm_reachable(), reason="no SLURM cluster reachable (sinfo)")
@pytest.mark.parametrize(("overrides", "expected"), [
    (["slurm.gpu_request=gres"], ["Invalid generic resource", "slurm.gpu_request=none"]),
    # more tasks than the node has CPUs, each data-parallel rank with a sample of the batch
    (["slurm.gpu_request=none", "n_devices_per_node=64", "dataset.batch_size=64"],
     ["Requested node configuration is not available", "lower `n_devices_per_node`"]),
    (["slurm.partition=no_such_partition"], ["partition", "set `slurm.partition`"]),
])
def test_a_job_the_cluster_refuses_is_one_line_with_the_fix(tmp_path, overrides, expected):
    gpu_nodes = "gpu" in subprocess.run(["sinfo", "-h", "-o", "%G"], capture_output=True,
                                        text=True, timeout=10).stdout
    if gpu_nodes and "slurm.gpu_request=gres" in overrides:
        pytest.skip("this cluster has GPU nodes: gres is valid here")
    result = _dry_run(tmp_path, "n_devices_per_node=2", *overrides)
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stdout + result.stderr
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "SLURM refuses this job (`sbatch --test-only`)" in errors[0]
    assert all(text in errors[0] for text in expected), errors[0]
    assert not (tmp_path / "sft").exists()


@pytest.mark.slurm
@pytest.mark.skipif(not _slurm_reachable(), reason="no SLURM cluster reachable (sinfo)")
def test_auto_asks_sinfo_whether_the_nodes_have_gpus(tmp_path):
    gres = subprocess.run(["sinfo", "-h", "-o", "%G"], capture_output=True, text=True,
                          timeout=10).stdout
    result = _dry_run(tmp_path, "n_devices_per_node=2")  # slurm.gpu_request=auto
    assert result.returncode == 0, result.stderr
    assert ("#SBATCH --gres=gpu:2" in result.stdout) == lists_gpu_gres(gres), result.stdout
    expected = "gres" if lists_gpu_gres(gres) else "none"
    assert f"  gpu_request: {expected}\n" in result.stdout
