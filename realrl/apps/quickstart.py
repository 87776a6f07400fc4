"""The realrl command line.

    python -m realrl.apps.quickstart                          list experiments
    python -m realrl.apps.quickstart ppo-math --help          every config key
    python -m realrl.apps.quickstart ppo-math --dry-run k=v   validate and show the plan
    python -m realrl.apps.quickstart ppo-math k=v ...         run
    options: --config FILE.yaml (repeatable), --import MODULE_OR_FILE.py (repeatable)

A mistake in user input prints what is wrong and how to fix it, and exits with status 2.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import sys
from typing import TextIO

from realrl.api.config import ConfigError, iter_fields, resolve_config, to_yaml
from realrl.api.registry import (
    RegistryError,
    get_experiment,
    import_user_module,
    list_experiments,
    load_plugins,
)

USAGE_EXIT_CODE = 2


def _parse_arguments(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m realrl.apps.quickstart",
        description="Run a realrl experiment. Without an experiment name, list them.",
        add_help=False,
    )
    parser.add_argument("experiment", nargs="?", help="registered experiment name")
    parser.add_argument("overrides", nargs="*", help="key=value overrides (Hydra syntax)")
    parser.add_argument("--config", action="append", default=[], help="YAML config file")
    parser.add_argument("--import", dest="imports", action="append", default=[],
                        help="module path or .py file that registers experiments")
    parser.add_argument("--dry-run", action="store_true", help="validate and print the plan")
    parser.add_argument("-h", "--help", action="store_true", help="show help")
    return parser.parse_intermixed_args(argv)


def _print_experiments(out: TextIO) -> None:
    out.write("realrl experiments (run `python -m realrl.apps.quickstart NAME --help`):\n")
    for entry in list_experiments():
        out.write(f"  {entry.name:<12} {entry.description}\n")


def _print_config_help(name: str, config_class: type, out: TextIO) -> None:
    out.write(f"usage: python -m realrl.apps.quickstart {name} [--dry-run] [--config FILE] "
              f"[key=value ...]\n\n{(config_class.__doc__ or '').strip()}\n\nkeys:\n")
    for info in iter_fields(config_class):
        default = "(required)" if info.default is dataclasses.MISSING else repr(info.default)
        out.write(f"  {info.key} : {info.type_name} = {default}\n      {info.help}\n")


def main(argv: list[str] | None = None, out: TextIO = sys.stdout) -> int:
    argv = sys.argv[1:] if argv is None else argv
    logging.basicConfig(level=logging.INFO, format="[%(name)s] %(levelname)s %(message)s")
    args = _parse_arguments(argv)
    try:
        import realrl.experiments  # noqa: F401  (registers the built-in experiments)

        load_plugins()
        for module in args.imports:
            import_user_module(module)
        if args.experiment is None:
            _print_experiments(out)
            return 0
        entry = get_experiment(args.experiment)
        if args.help:
            _print_config_help(entry.name, entry.config_class, out)
            return 0
        config = resolve_config(
            entry.config_class, args.overrides, args.config,
            defaults={"experiment_name": entry.name},
        )
        if args.dry_run:  # the same checks as a start (`realrl.launcher.preflight`)
            from realrl.launcher.preflight import prepare_launch

            out.write(prepare_launch(config).describe(to_yaml(config)))
            if config.mode.value == "slurm":
                from realrl.launcher.slurm import describe_dry_run

                out.write("\n" + describe_dry_run(config))
            return 0
        from realrl.launcher.run import run_experiment

        return run_experiment(config)
    except (ConfigError, RegistryError) as exc:
        sys.stderr.write(f"error: {exc}\n")
        return USAGE_EXIT_CODE
    except ValueError as exc:  # graph, allocation and dataset errors subclass ValueError
        if type(exc).__module__.startswith("realrl."):
            sys.stderr.write(f"error: {exc}\n")
            return USAGE_EXIT_CODE
        raise


if __name__ == "__main__":
    sys.exit(main())
