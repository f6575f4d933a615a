"""Follow-up passes (issue #19): the canonical pass emits drawn inputs and no plan state; the
deployment forms are small passes over what it tagged — ``hash_random`` (the export),
``keep_plans`` / ``reuse_plans`` / ``either_plans`` (plan_every) and ``fallback_plans``
(importance merging's one graph for every step), ``head_merges`` (the export's merges)."""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch
from conftest import dynamo_graph
from tome_compile.passes.follow_up import fallback_plans, hash_random, head_merges, keep_plans, reuse_plans

from tome_compile import ToMeConfig, merge_self_attention
from tome_compile.errors import ToMeRewriteError
from tome_compile.merge import (
    fit_importance,
    importance_plan,
    merge_tokens,
    merge_tokens_by_heads,
    oracle_merge,
    tome_plan,
)
from tome_compile.plans import fit_map, importance_or_tome_plan, make_plan, pack_plans, unpack_plan
from tome_compile.sampler import block_cells, hashed_block_cells, hashed_partition

CONFIG = ToMeConfig(ratio=0.5, max_downsample=2)


def calls(gm, fn):
    """Calls of ``fn``; a plan function (tome_plan, importance_plan) counts the rewrite's
    ``make_plan`` nodes of that method."""
    fn = fit_map if fn is fit_importance else fn  # the rewrite fits the map to the block's sizes
    method = {tome_plan: "tome", importance_plan: "importance"}.get(fn)
    if method is not None:
        return [n for n in gm.graph.nodes if n.op == "call_function" and n.target is make_plan
                and n.kwargs.get("method") == method]
    return [n for n in gm.graph.nodes if n.op == "call_function" and n.target is fn]


def run(gm, args):
    with torch.no_grad():
        return gm(*args)


def test_hash_random_turns_the_drawn_partition_into_a_seed(sd15):
    unet, inputs = sd15
    gm = dynamo_graph(unet, inputs)
    args = list(gm.graph_args)
    drawn = merge_self_attention(gm, CONFIG)
    assert drawn.input_names == ["tome_partition"]
    (spec,) = drawn.inputs
    drawn_gm = copy.deepcopy(gm)

    hashed = hash_random(gm, drawn)
    placeholders = [n.name for n in gm.graph.nodes if n.op == "placeholder"]
    assert hashed.input_names == ["tome_seed"] and placeholders[-1] == "tome_seed"
    assert "tome_partition" not in placeholders and not calls(gm, hashed_partition)
    # each block hashes its own cells, after its input exists (not the whole partition up front:
    # ONNX Runtime would make it at the start of a call and hold every block's cells to the end)
    cells = calls(gm, hashed_block_cells)
    assert len(cells) == 4 and not calls(gm, block_cells)
    for node in cells:
        (plan,) = node.users
        assert node.kwargs["metric"] is plan.kwargs["metric"]  # the block's input, what its plan matches on
    assert hashed.count_nodes("merge") == drawn.count_nodes("merge") == 4
    assert all("destinations hashed from (tome_seed, timestep)" in s.reason for s in hashed.rewritten)

    # the hashed graph is the drawn graph fed hashed_partition(seed, timestep), bit for bit
    timestep = args[hashed.io.timestep_index]
    partition = hashed_partition(torch.tensor(5), timestep, spec.shape[0], spec.choices)
    got = run(gm, [*args, torch.tensor(5)])[0]
    assert torch.equal(got, run(drawn_gm, [*args, partition])[0])
    assert not torch.equal(got, run(gm, [*args, torch.tensor(6)])[0])  # another seed, other merges


def test_hash_random_leaves_a_graph_that_draws_nothing_and_needs_a_timestep(sd15):
    unet, inputs = sd15
    gm = dynamo_graph(unet, inputs)
    fixed = merge_self_attention(gm, CONFIG.replace(use_rand=False))
    code = gm.code
    assert hash_random(gm, fixed) is fixed and gm.code == code and not fixed.inputs

    gm = dynamo_graph(unet, inputs)
    drawn = merge_self_attention(gm, CONFIG)
    with pytest.raises(ToMeRewriteError, match="need the timestep as a graph input"):
        hash_random(gm, dataclasses.replace(drawn, io=None))


def test_keep_plans_returns_the_plans_a_reusing_graph_reproduces(sd15):
    unet, inputs = sd15
    config = CONFIG.replace(plan_every=2)
    gm = dynamo_graph(unet, inputs)
    args = list(gm.graph_args)
    canonical = merge_self_attention(gm, config)
    plain_out = copy.deepcopy(gm)

    kept = keep_plans(gm, canonical)
    assert [s.name for s in kept.outputs] == ["tome_plan_slots_out", "tome_plan_weights_out"]
    assert kept.plan_state == "make" and len(calls(gm, pack_plans)) == 1 and kept.inputs == canonical.inputs
    partition = torch.randint(4, canonical.inputs[0].shape)
    out, slots, weights = run(gm, [*args, partition])
    assert torch.equal(out, run(plain_out, [*args, partition])[0])  # the model's output unchanged
    assert slots.shape == kept.outputs[0].shape and weights.shape == kept.outputs[1].shape

    reuse_gm = dynamo_graph(unet, inputs)
    reuse = reuse_plans(reuse_gm, merge_self_attention(reuse_gm, config))
    assert torch.equal(run(reuse_gm, [*args, slots, weights])[0], out)  # the same plans, the same output

    # negative: a graph whose plans are fed, or that returns them already, is refused
    with pytest.raises(ToMeRewriteError, match="plans are not its own"):
        keep_plans(reuse_gm, reuse)
    with pytest.raises(ToMeRewriteError, match="already returned"):
        keep_plans(gm, kept)


def test_reuse_plans_drops_the_matching_and_what_only_it_read(sd15):
    unet, inputs = sd15
    gm = dynamo_graph(unet, inputs)
    importance = merge_self_attention(gm, CONFIG.replace(method="importance", plan_every=2))
    assert importance.input_names == ["tome_importance", "tome_dst_key"] and calls(gm, fit_importance)
    reused = reuse_plans(gm, importance)
    # the map, the keys and every fitted copy of the map are gone with the matching
    assert reused.input_names == ["tome_plan_slots", "tome_plan_weights"] and not calls(gm, fit_importance)
    assert len(calls(gm, unpack_plan)) == 4 and reused.count_nodes("merge") == 4
    assert reused.plan_state == "reuse"
    assert all("plan of an earlier call (plan_every=2)" in s.reason for s in reused.rewritten)
    with pytest.raises(ToMeRewriteError, match="already has plan state"):
        reuse_plans(gm, reused)

    gm = dynamo_graph(unet, inputs)
    oracle = merge_self_attention(gm, CONFIG, oracle=True)  # no plan to feed: left as it is
    assert reuse_plans(gm, oracle) is oracle and not calls(gm, tome_plan)


def test_fallback_plans_is_the_importance_graph_with_a_map_and_the_tome_graph_without(sd15):
    unet, inputs = sd15
    gm = dynamo_graph(unet, inputs)
    args = list(gm.graph_args)
    importance = merge_self_attention(gm, CONFIG.replace(method="importance"))
    importance_gm = copy.deepcopy(gm)
    tome_gm = dynamo_graph(unet, inputs)
    tome = merge_self_attention(tome_gm, CONFIG)

    both = fallback_plans(gm, importance)
    # the flag right after the map (the export's input order), the ToMe branch's partition last
    assert both.input_names == ["tome_importance", "tome_has_map", "tome_dst_key", "tome_partition"]
    assert both.inputs[-1] == tome.inputs[0]
    assert len(calls(gm, importance_or_tome_plan)) == 4 and not calls(gm, importance_plan)
    assert both.count_nodes("merge") == importance.count_nodes("merge") == 4
    assert all("ToMe plan when there is no map (tome_has_map)" in s.reason for s in both.rewritten)

    g = torch.Generator().manual_seed(0)
    spec = {s.draw: s for s in both.inputs}
    importance_map = torch.rand(spec["importance"].shape, generator=g)
    key = torch.rand(spec["dst_key"].shape, generator=g)
    partition = torch.randint(0, spec["partition"].choices, spec["partition"].shape, generator=g)
    with_map = run(gm, [*args, importance_map, torch.tensor(True), key, partition])[0]
    without = run(gm, [*args, importance_map, torch.tensor(False), key, partition])[0]
    assert torch.equal(with_map, run(importance_gm, [*args, importance_map, key])[0])
    assert torch.equal(without, run(tome_gm, [*args, partition])[0])
    assert not torch.equal(with_map, without)

    # a ToMe graph has no importance plan to fall back from; plan state must come after
    code = tome_gm.code
    assert fallback_plans(tome_gm, tome) is tome and tome_gm.code == code
    gm = dynamo_graph(unet, inputs)
    kept = keep_plans(gm, merge_self_attention(gm, CONFIG.replace(method="importance", plan_every=2)))
    with pytest.raises(ToMeRewriteError, match="already has plan state"):
        fallback_plans(gm, kept)


def test_head_merges_swaps_every_merge_for_the_one_that_scatters_r_tokens(sd15):
    unet, inputs = sd15
    gm = dynamo_graph(unet, inputs)
    args = list(gm.graph_args)
    drawn = merge_self_attention(gm, CONFIG)
    partition = drawn.inputs[0].zeros()
    expected = run(gm, [*args, partition])[0]
    assert len(calls(gm, merge_tokens)) == 4

    heads = head_merges(gm, drawn)
    assert len(calls(gm, merge_tokens_by_heads)) == 4 and not calls(gm, merge_tokens)
    assert heads.count_nodes("merge") == 4 and heads.input_names == drawn.input_names
    assert all("merge scatters the r merged tokens only" in s.reason for s in heads.rewritten)
    got = run(gm, [*args, partition])[0]
    assert torch.equal(got, expected)  # the same sums in the same order

    gm = dynamo_graph(unet, inputs)
    oracle = merge_self_attention(gm, CONFIG, oracle=True)  # negative: no merge_tokens to swap
    assert head_merges(gm, oracle) is oracle and calls(gm, oracle_merge)
    assert not calls(gm, merge_tokens_by_heads)
