"""`--help` (and docs/config.md, rendered by the same `iter_fields`) shows what a run of each
experiment uses: every key's shown default equals its value in `--dry-run`'s resolved config,
and every `<role>.path` help says what the launcher loads for an empty path."""

import ast
import io
import re
from pathlib import Path

import pytest
from omegaconf import OmegaConf

import realrl.experiments  # noqa: F401  (registers the built-in experiments)
from realrl.api import environment
from realrl.api.config import iter_fields, resolve_config
from realrl.api.experiment import (
    FRESH_MODEL_PATH_HELP,
    TOOL_WARM_START_PATH_HELP,
    WARM_START_PATH_HELP,
    ModelRoleConfig,
)
from realrl.api.registry import get_experiment, list_experiments
from realrl.apps.quickstart import main
from realrl.launcher.preflight import resolve_model_paths
from realrl.launcher.warm_start import PACKAGED_ACTOR, PACKAGED_AGENT

EXPERIMENTS = [entry.name for entry in list_experiments()]

# Keys whose value is derived when the config is resolved, so the resolved value differs from
# the default that help shows by design.
RESOLVED_AT_LAUNCH = {
    "experiment_name",  # "" = the registered experiment's name
    "n_devices_per_node",  # 0 = detect this machine's GPUs or cores
    # null = from the model's context (`realrl.launcher.preflight.context_problems`)
    "dataset.max_prompt_len", "dataset.max_seq_len",
}
HELP_LINE = re.compile(r"^  (?P<key>\S+) : .* = (?P<default>.*)$")


def _cli_output(*argv: str) -> str:
    out = io.StringIO()
    assert main(list(argv), out=out) == 0
    return out.getvalue()


def _help_defaults(experiment: str) -> dict:
    """Each key's default as `--help` prints it (a Python literal), parsed back."""
    defaults = {}
    for line in _cli_output(experiment, "--help").splitlines():
        match = HELP_LINE.match(line)
        if match:
            defaults[match["key"]] = ast.literal_eval(match["default"])
    return defaults


def _dry_run_values(experiment: str) -> dict:
    """The config `--dry-run` prints under `# resolved config`, as plain Python values."""
    text = _cli_output(experiment, "--dry-run")
    yaml_text = text.split("# resolved config\n", 1)[1].split("\n\n# ", 1)[0]
    return OmegaConf.to_container(OmegaConf.create(yaml_text))


def _lookup(values: dict, key: str):
    for part in key.split("."):
        values = values[part]
    return values


@pytest.mark.parametrize("experiment", EXPERIMENTS)
def test_help_shows_the_defaults_a_dry_run_resolves(experiment, tmp_path, monkeypatch):
    monkeypatch.setenv(environment.CACHE, str(tmp_path))  # where a fresh model is written
    shown = _help_defaults(experiment)
    entry = get_experiment(experiment)
    assert set(shown) == {info.key for info in iter_fields(entry.config_class)}
    resolved = _dry_run_values(experiment)
    # A role's `dtype` shows null ("inherit") and resolves to the run-wide `dtype` (a linked
    # role's to its source's, which is the run-wide one by default).
    inherited = {key for key, default in shown.items() if key.endswith(".dtype") and default is None}
    assert inherited, f"{experiment} has no model role with an inherited dtype"
    assert {_lookup(resolved, key) for key in inherited} == {shown["dtype"]}
    # An empty `<role>.path` resolves to what it loads (the next test checks what that is).
    model_paths = {key for key in shown if key.endswith(".path") and key != "dataset.path"}
    wrong = {
        key: (default, _lookup(resolved, key))
        for key, default in shown.items()
        if key not in RESOLVED_AT_LAUNCH | inherited | model_paths
        and default != _lookup(resolved, key)
    }
    assert not wrong, f"{experiment}: key: (--help default, --dry-run value): {wrong}"


@pytest.mark.parametrize("experiment", EXPERIMENTS)
def test_model_path_help_says_what_an_empty_path_loads(experiment, tmp_path, monkeypatch):
    monkeypatch.setenv(environment.CACHE, str(tmp_path))  # where a fresh model is written
    entry = get_experiment(experiment)
    config = resolve_config(entry.config_class, defaults={"experiment_name": experiment})
    resolve_model_paths(config)  # what the launcher does before starting any worker
    help_texts = {info.key: info.help for info in iter_fields(entry.config_class)}
    roles = [name for name, value in vars(config).items() if isinstance(value, ModelRoleConfig)]
    assert roles
    for role in roles:
        text, loaded = help_texts[f"{role}.path"], Path(getattr(config, role).path)
        if text == WARM_START_PATH_HELP:
            assert loaded == PACKAGED_ACTOR, role
        elif text == TOOL_WARM_START_PATH_HELP:
            assert loaded == PACKAGED_AGENT, role
        elif text == FRESH_MODEL_PATH_HELP:
            assert loaded == tmp_path / "default-fresh", role
        else:
            source = re.search(r"empty: `(\w+)\.path`", text)
            assert source, f"{experiment} {role}.path help names no source: {text}"
            assert loaded == Path(getattr(config, source[1]).path), role
