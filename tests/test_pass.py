"""The FX pass on Dynamo and torch.export graphs: structure, numerics, negative cases."""

from __future__ import annotations

import copy

import pytest
import torch
from conftest import call, dynamo_graph, tiny_inputs, tiny_unet, tomesd_reference
from tome_compile.passes import PARTITION_INPUT, find_attention_sites

from tome_compile import ToMeConfig, merge_self_attention

SD15_SELF = [
    "down_blocks.0.attentions.0.transformer_blocks.0.attn1",
    "up_blocks.1.attentions.0.transformer_blocks.0.attn1",
    "up_blocks.1.attentions.1.transformer_blocks.0.attn1",
]


def run_graph(gm, inputs, *extra):
    args = gm.graph_args if hasattr(gm, "graph_args") else inputs.args()
    with torch.no_grad():
        out = gm(*args, *extra)
    return out[0] if isinstance(out, (tuple, list)) else out


def test_finds_every_attention_by_structure(sd15):
    unet, inputs = sd15
    sites = find_attention_sites(dynamo_graph(unet, inputs))
    kinds = [(s.path, s.kind) for s in sites]
    assert len(sites) == 8
    assert [p for p, k in kinds if k == "self-attention"] == [
        SD15_SELF[0], "mid_block.attentions.0.transformer_blocks.0.attn1", SD15_SELF[1], SD15_SELF[2]]
    assert all(p.endswith("attn2") for p, k in kinds if k == "cross-attention")
    assert [s.tokens for s in sites if s.kind == "self-attention"] == [256, 64, 256, 256]


def test_rewrites_exactly_the_high_resolution_self_attention(sd15):
    unet, inputs = sd15
    gm = dynamo_graph(unet, inputs)
    result = merge_self_attention(gm, ToMeConfig(ratio=0.5, use_rand=False))
    assert result.modified
    assert [s.path for s in result.rewritten] == SD15_SELF
    assert all(s.tokens == 256 and s.tokens_after == 128 and s.grid == (16, 16) for s in result.rewritten)
    assert result.count_nodes("merge") == 3 and result.count_nodes("unmerge") == 3
    assert result.inputs == []  # use_rand=False: exactly the standard inputs
    skipped = {s.path: s.reason for s in result.sites if not s.rewritten}
    assert skipped["mid_block.attentions.0.transformer_blocks.0.attn1"].startswith(
        "downsample 2 > max_downsample=1")
    assert all(reason == "cross-attention" for path, reason in skipped.items() if path.endswith("attn2"))
    gm.graph.lint()
    # Cross-attention untouched: no inserted node feeds an attn2 region.
    for node in gm.graph.nodes:
        if node.meta.get("tome", {}).get("role") == "merge":
            assert all("attn2" not in str(u.meta.get("nn_module_stack", "")) for u in node.users)
    ref = tomesd_reference(unet, ratio=0.5, use_rand=False)
    assert (run_graph(gm, inputs) - call(ref, inputs)).abs().max() < 1e-4


def test_ratio_zero_leaves_the_graph_untouched(sd15):
    unet, inputs = sd15
    gm = dynamo_graph(unet, inputs)
    before = gm.code
    result = merge_self_attention(gm, ToMeConfig(ratio=0.0))
    assert not result.modified and result.rewritten == [] and gm.code == before
    assert all("nothing to merge" in s.reason or "cross" in s.reason for s in result.sites)
    assert torch.equal(run_graph(gm, inputs), call(unet, inputs))


def test_max_downsample_2_adds_the_mid_block(sd15):
    unet, inputs = sd15
    gm = dynamo_graph(unet, inputs)
    result = merge_self_attention(gm, ToMeConfig(ratio=0.5, max_downsample=2, use_rand=False))
    assert len(result.rewritten) == 4
    mid = [s for s in result.rewritten if s.path.startswith("mid_block")][0]
    assert (mid.tokens, mid.tokens_after, mid.grid) == (64, 32, (8, 8))
    ref = tomesd_reference(unet, ratio=0.5, max_downsample=2, use_rand=False)
    assert (run_graph(gm, inputs) - call(ref, inputs)).abs().max() < 1e-4


def test_random_partition_is_a_graph_input(sd15):
    unet, inputs = sd15
    gm = dynamo_graph(unet, inputs)
    result = merge_self_attention(gm, ToMeConfig(ratio=0.5))
    assert result.input_names == [PARTITION_INPUT]
    (spec,) = result.inputs
    assert spec.cells == ((8, 8),) * 3 and spec.shape == (192,) and spec.dtype == torch.int64
    placeholders = [n.name for n in gm.graph.nodes if n.op == "placeholder"]
    assert placeholders[-1] == PARTITION_INPUT
    # No random op inside the graph.
    assert not any("rand" in str(n.target) for n in gm.graph.nodes if n.op == "call_function")
    g = torch.Generator().manual_seed(3)
    partition = torch.cat([torch.randint(4, (8, 8, 1), generator=g).reshape(-1) for _ in range(3)])
    ref = tomesd_reference(unet, seed=3, ratio=0.5)
    assert (run_graph(gm, inputs, partition) - call(ref, inputs)).abs().max() < 1e-4


@pytest.mark.parametrize("targets", [dict(merge_crossattn=True), dict(merge_mlp=True),
                                     dict(merge_attn=False, merge_mlp=True)])
def test_crossattn_and_mlp_merge_with_the_same_plan(sd15, targets):
    unet, inputs = sd15
    gm = dynamo_graph(unet, inputs)
    result = merge_self_attention(gm, ToMeConfig(ratio=0.5, use_rand=False, **targets))
    per_site = sum(targets.get(k, k == "merge_attn") for k in ("merge_attn", "merge_crossattn", "merge_mlp"))
    assert result.count_nodes("merge") == 3 * per_site
    assert result.count_nodes("unmerge") == 3 * per_site
    ref = tomesd_reference(unet, ratio=0.5, use_rand=False, **targets)
    assert (run_graph(gm, inputs) - call(ref, inputs)).abs().max() < 1e-4


def test_classic_attn_processor_with_baked_token_counts():
    from diffusers.models.attention_processor import AttnProcessor

    unet = tiny_unet("sd15")
    unet.set_attn_processor(AttnProcessor())
    inputs = tiny_inputs(unet)
    gm = dynamo_graph(unet, inputs)
    assert any(256 in n.args for n in gm.graph.nodes if n.op == "call_method" and n.target == "reshape")
    result = merge_self_attention(gm, ToMeConfig(ratio=0.5, use_rand=False))
    assert [s.path for s in result.rewritten] == SD15_SELF
    assert {s.path for s in result.sites if s.kind == "self-attention"} >= set(SD15_SELF)
    ref = tomesd_reference(unet, ratio=0.5, use_rand=False)
    assert (run_graph(gm, inputs) - call(ref, inputs)).abs().max() < 1e-4


def test_torch_export_graph():
    unet = tiny_unet("sd2")
    inputs = tiny_inputs(unet)
    ep = torch.export.export(unet, (), inputs.kwargs())
    gm = ep.module()
    result = merge_self_attention(gm, ToMeConfig(ratio=0.5, use_rand=False))
    assert len(result.rewritten) == 3  # down_blocks.0 and two up_blocks.2 attentions
    assert all(s.tokens == 256 for s in result.rewritten)
    with torch.no_grad():
        out = gm(**inputs.kwargs())[0]
    ref = tomesd_reference(unet, ratio=0.5, use_rand=False)
    assert (out - call(ref, inputs)).abs().max() < 1e-4


def test_no_attention_no_sites():
    # Negative case: a conv net has no attention; the pass reports nothing and changes nothing.
    model = torch.nn.Sequential(torch.nn.Conv2d(4, 8, 3, padding=1), torch.nn.SiLU(),
                                torch.nn.Conv2d(8, 4, 3, padding=1))
    gm = torch.fx.symbolic_trace(model)
    before = gm.code
    result = merge_self_attention(gm, ToMeConfig())
    assert result.sites == [] and not result.modified and gm.code == before


def test_unsupported_site_is_skipped_with_a_reason(sd15):
    unet, inputs = sd15
    gm = dynamo_graph(unet, inputs)
    # Strip the module metadata of one self-attention: it cannot be scoped, so it is skipped.
    for node in find_attention_sites(gm)[0].nodes:
        node.meta.pop("nn_module_stack")
    result = merge_self_attention(gm, ToMeConfig(ratio=0.5, use_rand=False))
    reasons = [s.reason for s in result.sites if not s.rewritten]
    assert "no nn_module_stack metadata to scope the region" in reasons
    assert len(result.rewritten) == 2
    copy.deepcopy(gm.graph).lint()
    # the attention op alone without it: the module (named by its projections) hands its q, k, v
    # out to a node outside it, and the reason names them
    gm = dynamo_graph(unet, inputs)
    find_attention_sites(gm)[0].anchor.meta.pop("nn_module_stack")
    result = merge_self_attention(gm, ToMeConfig(ratio=0.5, use_rand=False))
    (skipped,) = [s for s in result.sites if s.path == SD15_SELF[0]]
    assert not skipped.rewritten and skipped.reason.startswith("its region hands out query")
    assert "(transpose in down_blocks.0.attentions.0.transformer_blocks.0.attn1)" in skipped.reason
    assert len(result.rewritten) == 2


def test_a_rewrite_that_does_not_type_check_is_put_back(monkeypatch):
    # Without the literal-token fix, the classic processor's baked reshapes cannot take the merged
    # tokens: the shape check catches it, the sites are reported as skipped, the graph still runs.
    import importlib

    from diffusers.models.attention_processor import AttnProcessor

    rewrite_module = importlib.import_module("tome_compile.passes.rewrite")
    unet = tiny_unet("sd15")
    unet.set_attn_processor(AttnProcessor())
    inputs = tiny_inputs(unet)
    gm = dynamo_graph(unet, inputs)
    monkeypatch.setattr(rewrite_module, "_replace_literal_tokens", lambda *a, **k: 0)
    result = merge_self_attention(gm, ToMeConfig(ratio=0.5, use_rand=False))
    assert not result.modified and result.rewritten == []
    failed = [s for s in result.sites if "failed the shape check" in s.reason]
    assert [s.path for s in failed] == SD15_SELF
    assert torch.equal(run_graph(gm, inputs), call(unet, inputs))
