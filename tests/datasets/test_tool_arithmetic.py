"""The built-in agentic task: multiplication records, and SFT transcripts written in exactly
the call and tool-turn format the episodes parse and write."""

from __future__ import annotations

from realrl.api.episode_config import EpisodeConfig
from realrl.api.experiment import BuiltinSplit, BuiltinTask, DatasetKind
from realrl.datasets.tool_arithmetic import (
    as_tool_sft_records,
    make_multiplication_splits,
    tool_transcript,
)
from realrl.episodes.tools import ToolBox
from realrl.episodes.turns import RAW_TOOL_OUTPUT
from realrl.workers.data_source import builtin_records


def test_multiplication_records_are_two_and_three_digit_products():
    train, evaluation = make_multiplication_splits(200, 50, seed=0)
    assert not {r["prompt"] for r in train} & {r["prompt"] for r in evaluation}
    for record in train + evaluation:
        left, right = record["prompt"].rstrip("=").split("*")
        assert 2 <= len(left) <= 3 and 2 <= len(right) <= 3
        assert record["answer"] == str(int(left) * int(right))


def test_the_builtin_task_key_serves_the_multiplication_records():
    records = builtin_records(DatasetKind.prompt, BuiltinSplit.train, 8, BuiltinTask.multiplication)
    assert len(records) == 8 and all("*" in r["prompt"] for r in records)
    arithmetic = builtin_records(DatasetKind.prompt, BuiltinSplit.train, 8)
    assert [r["prompt"] for r in arithmetic] != [r["prompt"] for r in records]


def test_a_transcripts_call_runs_and_its_output_turn_is_the_episodes():
    toolbox = ToolBox(EpisodeConfig())
    for tool in ("calc", "python"):
        transcript = tool_transcript("417*386=", "160962", tool)
        call_text, rest = transcript.split("<eos>")
        output = toolbox.run(toolbox.parse(call_text))
        assert output.ok and output.text == "160962"
        assert rest == RAW_TOOL_OUTPUT.format(output=output.text) + "160962"


def test_about_tool_fraction_of_the_sft_records_call_a_tool():
    train, _ = make_multiplication_splits(1000, 10, seed=0)
    records = as_tool_sft_records(train, seed=1, tool_fraction=0.5)
    calls = sum("out(" in r["answer"] for r in records)
    assert 400 < calls < 600
    assert all(r["answer"].endswith(t["answer"]) for r, t in zip(records, train))
