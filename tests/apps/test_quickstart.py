"""The CLI as a user drives it: real subprocesses of `python -m realrl.apps.quickstart`."""

import os
import subprocess
import sys
import textwrap

QUICKSTART = [sys.executable, "-m", "realrl.apps.quickstart"]


def run_cli(*args, cwd=None):
    return subprocess.run([*QUICKSTART, *args], capture_output=True, text=True, timeout=120,
                          cwd=cwd)


def test_no_arguments_lists_every_experiment():
    result = run_cli()
    assert result.returncode == 0
    for name in ("ppo-math", "sft", "rw", "dpo", "gen"):
        assert f"  {name} " in result.stdout


def test_help_lists_every_config_key_with_type_and_default():
    result = run_cli("ppo-math", "--help")
    assert result.returncode == 0
    assert "ppo.eps_clip : float = 0.2" in result.stdout
    assert "allocation_mode : str = 'auto'" in result.stdout


def test_dry_run_prints_six_mfcs_edges_and_allocation_table(tmp_path):
    result = run_cli("ppo-math", "--dry-run", f"output_root={tmp_path}")
    assert result.returncode == 0, result.stderr
    out = result.stdout
    for name in ("actor_gen", "rew_inf", "ref_inf", "critic_inf", "actor_train", "critic_train"):
        assert f"] {name} (" in out
    assert "-> packed_input_ids" in out and "from actor_gen" in out
    assert "# allocations" in out and "# workers" in out
    assert not (tmp_path / "ppo-math").exists()  # a dry run starts and writes nothing


def test_unknown_key_exits_non_zero_naming_it_without_traceback():
    result = run_cli("ppo-math", "--dry-run", "actor.nonexistent=1")
    assert result.returncode == 2
    assert "actor.nonexistent" in result.stderr
    assert "Traceback" not in result.stderr + result.stdout


def test_a_bad_shared_memory_setting_is_refused_before_anything_starts(tmp_path):
    result = subprocess.run(
        [*QUICKSTART, "sft", f"output_root={tmp_path}"], capture_output=True, text=True,
        timeout=120, env={**os.environ, "REALRL_SHARED_MEMORY": "off"},
    )
    assert result.returncode == 2
    assert "REALRL_SHARED_MEMORY='off' is neither 0 nor 1" in result.stderr
    assert "set it to 0" in result.stderr and "Traceback" not in result.stderr
    assert not (tmp_path / "sft").exists()


def test_unknown_experiment_suggests_the_nearest():
    result = run_cli("ppo-mat")
    assert result.returncode == 2
    assert "Did you mean ppo-math" in result.stderr and "Traceback" not in result.stderr


def test_user_experiment_registers_through_import_of_a_file(tmp_path):
    module = tmp_path / "my_exp.py"
    module.write_text(textwrap.dedent('''
        from dataclasses import dataclass
        from realrl.api.registry import register_experiment
        from realrl.experiments.sft import SFTExperimentConfig

        @register_experiment("my-sft")
        @dataclass
        class MySFT(SFTExperimentConfig):
            """My own SFT variant."""
    '''))
    result = run_cli("--import", str(module))
    assert result.returncode == 0, result.stderr
    assert "my-sft" in result.stdout and "My own SFT variant." in result.stdout
    result = run_cli("my-sft", "--import", str(module), "--dry-run", f"output_root={tmp_path}")
    assert result.returncode == 0, result.stderr
    assert "trainDefault" in result.stdout


def test_broken_import_is_reported_without_traceback():
    result = run_cli("--import", "no_such_module_xyz")
    assert result.returncode == 2
    assert "no_such_module_xyz" in result.stderr and "Traceback" not in result.stderr


def test_pipeline_parallel_layouts_are_rejected_in_dry_run_with_a_fix():
    result = run_cli("ppo-math", "--dry-run", "n_devices_per_node=2", "allocation_mode=d1p2")
    assert result.returncode == 2
    assert "pipeline parallelism" in result.stderr and "'d2t1'" in result.stderr
