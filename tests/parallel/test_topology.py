"""Where the grid's groups land on nodes, checked in one process (no torch.distributed).

torchrun numbers ranks node by node (rank r on node r // LOCAL_WORLD_SIZE), so with ranks
varying fastest along tp a TP group stays inside a node exactly when tp divides the ranks per
node. A layout that breaks that is refused unless --allow-tp-across-nodes; the start-up line
that says where each kind of group landed stays one line at any scale.
"""
from __future__ import annotations

import pytest

from megazero.arguments import parse_config
from megazero.config import ConfigError
from megazero.parallel.layout import Layout, check_tp_inside_nodes, contiguous_nodes, describe_nodes
from megazero.training.run import validate


def test_ranks_fill_nodes_in_order():
    assert contiguous_nodes(8, 4) == [0, 0, 0, 0, 1, 1, 1, 1]
    assert contiguous_nodes(4, 1) == [0, 1, 2, 3]
    assert contiguous_nodes(3, 3) == [0, 0, 0]


@pytest.mark.parametrize("tp,world,per_node", [(4, 8, 2), (8, 16, 4), (2, 6, 3), (4, 12, 6), (3, 6, 2)])
def test_tp_group_across_nodes_is_refused_with_one_line(tp, world, per_node):
    layout = Layout.from_world(world, tp, 1)
    nodes = contiguous_nodes(world, per_node)
    with pytest.raises(ConfigError) as err:
        check_tp_inside_nodes(layout, nodes)
    line = str(err.value)
    assert "\n" not in line
    for words in (f"--tp {tp}", f"{per_node} ranks per node", "--allow-tp-across-nodes"):
        assert words in line, f"{words!r} not in {line!r}"
    check_tp_inside_nodes(layout, nodes, allow_across=True)  # the flag accepts it


@pytest.mark.parametrize("tp,dp,pp,per_node", [(1, 4, 2, 1), (2, 2, 2, 2), (2, 2, 2, 4), (4, 2, 1, 8),
                                                (8, 2, 4, 8), (2, 3, 1, 6), (2, 2, 1, 4)])
def test_tp_dividing_the_ranks_per_node_is_accepted(tp, dp, pp, per_node):
    layout = Layout(tp, dp, pp)
    nodes = contiguous_nodes(layout.world_size, per_node)
    check_tp_inside_nodes(layout, nodes)
    for group in layout.tp_groups():
        assert len({nodes[r] for r in group}) == 1


def test_refusal_reads_the_nodes_it_is_given():
    """After start-up the nodes are torchrun's own numbers; ranks dealt round-robin put TP across nodes."""
    layout = Layout(2, 2, 1)
    check_tp_inside_nodes(layout, [1, 1, 0, 0])  # nodes numbered the other way round: still inside
    with pytest.raises(ConfigError, match=r"TP group \[0, 1\] on nodes \[0, 1\]"):
        check_tp_inside_nodes(layout, [0, 1, 0, 1])


def test_validate_refuses_before_any_group_and_the_flag_overrides():
    """pretrain_gpt.py's path: validate() with LOCAL_WORLD_SIZE's value, then the CLI flag."""
    base = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--global-batch-size", "8"]
    cfg, _ = parse_config([*base, "--tp", "4"])
    assert validate(cfg, 8, ranks_per_node=4).tp == 4
    assert validate(cfg, 8).tp == 4  # no LOCAL_WORLD_SIZE: one node
    with pytest.raises(ConfigError, match="--allow-tp-across-nodes"):
        validate(cfg, 8, ranks_per_node=2)
    cfg, _ = parse_config([*base, "--tp", "4", "--allow-tp-across-nodes"])
    assert cfg.parallel.allow_tp_across_nodes
    assert validate(cfg, 8, ranks_per_node=2).tp == 4


def test_summary_of_tp_inside_and_dp_across_two_nodes():
    assert describe_nodes(Layout(2, 2, 1), contiguous_nodes(4, 2)) == (
        "2 nodes x 2 ranks (node n: ranks 2n..2n+1); tp groups inside one node; dp groups across 2 nodes; "
        "pp groups inside one node; pp stage 0 on nodes 0-1")


def test_summary_of_pipeline_stages_on_their_own_nodes():
    assert describe_nodes(Layout(2, 1, 2), contiguous_nodes(4, 2)) == (
        "2 nodes x 2 ranks (node n: ranks 2n..2n+1); tp groups inside one node; dp groups inside one node; "
        "pp groups across 2 nodes; pp stage 0 on node 0, 1 on node 1")


def test_summary_stays_one_short_line_at_a_thousand_ranks():
    layout = Layout(8, 16, 8)  # 1024 ranks on 128 nodes of 8
    text = describe_nodes(layout, contiguous_nodes(layout.world_size, 8))
    assert "\n" not in text and len(text) < 250, text
    assert text.startswith("128 nodes x 8 ranks (node n: ranks 8n..8n+7); tp groups inside one node; "
                           "dp groups across 16 nodes; pp groups across 8 nodes")
    assert text.endswith("pp stage 0 on nodes 0-15, 1 on nodes 16-31, ..., 7 on nodes 112-127")


def test_summary_of_one_node_and_of_uneven_nodes():
    assert describe_nodes(Layout(2, 2, 1), [0, 0, 0, 0]).startswith("1 node x 4 ranks; tp groups inside one node; "
                                                                     "dp groups inside one node")
    uneven = describe_nodes(Layout(1, 6, 1), [0, 0, 0, 0, 1, 1])
    assert uneven.startswith("2 nodes of 4/2 ranks; tp groups inside one node; dp groups across 2 nodes")
    assert "not numbered node by node" in describe_nodes(Layout(1, 4, 1), [1, 1, 0, 0])
