"""Errors written for the user (`realrl.api.errors`): which they are, and adding where."""

from __future__ import annotations

import traceback

import pytest

from realrl.api.config import ConfigError
from realrl.api.errors import UserFacingError
from realrl.datasets.jsonl import DatasetError
from realrl.rewards.remote import RemoteRewardError


def test_config_and_dataset_errors_are_written_for_the_user_and_still_value_errors():
    for error in (ConfigError(["`seed=-1` must be >= 0"]), DatasetError("data.jsonl:3: bad")):
        assert isinstance(error, UserFacingError) and isinstance(error, ValueError)


def test_adding_where_keeps_the_type_and_the_traceback_of_the_error():
    def score():
        raise RemoteRewardError("the reward service at http://h:1/score did not answer")

    with pytest.raises(RemoteRewardError) as raised:
        try:
            score()
        except UserFacingError as error:
            error.add_context("step 2, MFC remote_inf, role remote, rank 1")
            raise
    assert str(raised.value) == ("step 2, MFC remote_inf, role remote, rank 1: the reward "
                                 "service at http://h:1/score did not answer")
    frames = traceback.extract_tb(raised.value.__traceback__)
    assert frames[-1].name == "score"  # where it was raised, not where the context was added
    problems = ConfigError(["`a=1` is wrong", "`b=2` is wrong"])
    problems.add_context("rank 0")
    assert str(problems).startswith("rank 0: invalid configuration (2 problem(s)):\n  - `a=1`")
