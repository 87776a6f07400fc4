import pytest

from realrl.api.dfg import DataflowGraph, GraphError, MFCDef, MFCKind


def make_mfc(name, inputs=(), outputs=(), role="actor", kind=MFCKind.inference):
    return MFCDef(
        name=name, model_role=role, kind=kind, interface="x", input_keys=inputs, output_keys=outputs
    )


def ppo_like_mfcs():
    return [
        make_mfc("actor_gen", ("packed_prompts",), ("packed_input_ids",), kind="generate"),
        make_mfc("rew_inf", ("packed_input_ids",), ("rewards",), role="reward"),
        make_mfc("ref_inf", ("packed_input_ids",), ("ref_logprobs",), role="ref"),
        make_mfc(
            "actor_train", ("packed_input_ids", "rewards", "ref_logprobs"), (), kind="train_step"
        ),
    ]


ROLES = ("actor", "reward", "ref")


def test_graph_orders_mfcs_in_topological_levels():
    graph = DataflowGraph(ppo_like_mfcs(), ["packed_prompts"], ROLES)
    assert graph.levels == [["actor_gen"], ["ref_inf", "rew_inf"], ["actor_train"]]
    assert graph.sources == ["actor_gen"]
    assert graph.sinks == ["actor_train"]
    assert graph.parents["actor_train"] == ["actor_gen", "ref_inf", "rew_inf"]
    assert sorted(graph.children["actor_gen"]) == ["actor_train", "ref_inf", "rew_inf"]
    assert ("<dataset>", "actor_gen", "packed_prompts") in graph.edges()


def test_build_graph_rejects_duplicate_mfc_names():
    mfcs = ppo_like_mfcs() + [make_mfc("rew_inf", ("packed_input_ids",), ("other",), "reward")]
    with pytest.raises(GraphError, match="MFC name `rew_inf` is used by 2 MFCs"):
        DataflowGraph(mfcs, ["packed_prompts"], ROLES)


def test_build_graph_rejects_duplicate_producer():
    mfcs = ppo_like_mfcs() + [make_mfc("rew_inf2", ("packed_input_ids",), ("rewards",), "reward")]
    with pytest.raises(GraphError) as info:
        DataflowGraph(mfcs, ["packed_prompts"], ROLES)
    assert "key `rewards` is produced by both MFC `rew_inf` and MFC `rew_inf2`" in str(info.value)


def test_build_graph_rejects_mfc_output_that_shadows_a_dataset_key():
    mfcs = ppo_like_mfcs() + [make_mfc("loader", (), ("packed_prompts",))]
    with pytest.raises(
        GraphError,
        match="key `packed_prompts` is produced by MFC `loader` but also comes from the dataset",
    ):
        DataflowGraph(mfcs, ["packed_prompts"], ROLES)


def test_build_graph_rejects_cycle_and_names_its_mfcs_and_keys():
    mfcs = [
        make_mfc("a", ("y",), ("x",)),
        make_mfc("b", ("x",), ("y",)),
        make_mfc("c", ("prompts",), ("z",)),
    ]
    with pytest.raises(GraphError) as info:
        DataflowGraph(mfcs, ["prompts"], ROLES)
    message = str(info.value)
    assert "the MFCs `a`, `b` form a cycle" in message
    assert "`b` -> `a` (key `y`)" in message and "`a` -> `b` (key `x`)" in message


def test_build_graph_rejects_input_key_nobody_provides():
    mfcs = ppo_like_mfcs()
    mfcs[3] = make_mfc("actor_train", ("packed_input_ids", "rewardz"), (), kind="train_step")
    with pytest.raises(GraphError) as info:
        DataflowGraph(mfcs, ["packed_prompts"], ROLES)
    assert (
        "MFC `actor_train` needs key `rewardz`, which no MFC produces and the dataset does not "
        "provide"
    ) in str(info.value)
    assert "rewards" in str(info.value)  # the available keys are listed


def test_build_graph_rejects_undeclared_model_role():
    with pytest.raises(
        GraphError,
        match="MFC `rew_inf` runs on model role `reward`, which the experiment does not declare",
    ):
        DataflowGraph(ppo_like_mfcs(), ["packed_prompts"], ("actor", "ref"))


def test_build_graph_rejects_forward_keys_outside_train_inputs():
    mfcs = ppo_like_mfcs()
    mfcs[2].forward_keys = ("packed_input_ids",)  # an inference call
    mfcs[3].forward_keys = ("packed_input_ids", "values")  # not an input
    with pytest.raises(GraphError) as info:
        DataflowGraph(mfcs, ["packed_prompts"], ROLES)
    assert info.value.problems == [
        "MFC `ref_inf` (inference) has forward_keys; only train calls run their forward ahead.",
        "MFC `actor_train`: forward_keys ['values'] are not among its input_keys.",
    ]


def test_graph_errors_are_reported_together():
    mfcs = ppo_like_mfcs() + [make_mfc("x", ("missing",), ("rewards",), role="critic")]
    with pytest.raises(GraphError) as info:
        DataflowGraph(mfcs, ["packed_prompts"], ROLES)
    assert len(info.value.problems) == 3


def test_graph_renders_mermaid_and_dot_with_every_edge():
    graph = DataflowGraph(ppo_like_mfcs(), ["packed_prompts"], ROLES)
    mermaid, dot = graph.to_mermaid(), graph.to_dot()
    assert mermaid.startswith("flowchart TD")
    assert "mfc_actor_gen -->|packed_input_ids| mfc_rew_inf" in mermaid
    assert "dataset -->|packed_prompts| mfc_actor_gen" in mermaid
    assert dot.startswith("digraph dataflow {") and dot.rstrip().endswith("}")
    assert '"rew_inf" -> "actor_train" [label="rewards"];' in dot
    assert dot.count("->") == len(graph.edges())
