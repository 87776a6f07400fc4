from pathlib import Path

from realrl.apps.config_reference import render

DOC = Path(__file__).resolve().parents[2] / "docs" / "config.md"


def test_config_reference_matches_the_dataclasses():
    assert DOC.read_text() == render(), "docs/config.md is stale: run `make docs`"
