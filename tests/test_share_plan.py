"""share_plan (issue #11, first part): one plan per resolution level per U-Net call."""

from __future__ import annotations

import copy

import torch
from conftest import TINY_SD15, call, dynamo_graph, tiny_inputs, tiny_unet

from tome_compile import ToMeConfig, merge_self_attention, tome_backend
from tome_compile.merge import importance_or_tome_plan, tome_plan
from tome_compile.models import build_unet


def plan_nodes(gm, fn=tome_plan):
    return [n for n in gm.graph.nodes if n.op == "call_function" and n.target is fn]


def test_one_plan_per_level(sd15):
    unet, inputs = sd15
    gm = dynamo_graph(unet, inputs)
    result = merge_self_attention(gm, ToMeConfig(ratio=0.5, share_plan=True, max_downsample=2))
    assert len(result.rewritten) == 4  # three 256-token blocks and the 64-token mid block
    assert len(plan_nodes(gm)) == 2  # one per level: 256 and 64 tokens
    assert result.count_nodes("merge") == 4 and result.count_nodes("unmerge") == 4
    (spec,) = result.inputs  # one partition draw per level, at the block that makes the plan
    assert spec.cells == ((8, 8), (4, 4))
    reasons = {s.path: s.reason for s in result.rewritten}
    maker = "down_blocks.0.attentions.0.transformer_blocks.0.attn1"
    assert "shared" not in reasons[maker]
    assert "shared" not in reasons["mid_block.attentions.0.transformer_blocks.0.attn1"]  # its own level
    assert reasons["up_blocks.1.attentions.1.transformer_blocks.0.attn1"].endswith(f"plan shared from {maker}")
    gm.graph.lint()
    # negative: without share_plan, a plan per block
    exact = dynamo_graph(unet, inputs)
    merge_self_attention(exact, ToMeConfig(ratio=0.5, max_downsample=2))
    assert len(plan_nodes(exact)) == 4


def test_shared_plan_merges_with_the_makers_plan(sd15):
    unet, inputs = sd15
    model = torch.compile(copy.deepcopy(unet), backend=tome_backend(0.5, compiler="eager", share_plan=True,
                                                                    use_rand=False), fullgraph=True)
    exact = torch.compile(copy.deepcopy(unet), backend=tome_backend(0.5, compiler="eager", use_rand=False),
                          fullgraph=True)
    shared_out, exact_out = call(model, inputs), call(exact, inputs)
    assert shared_out.shape == exact_out.shape
    assert (shared_out - exact_out).abs().max() > 1e-6  # the up blocks merge with the first block's plan


def test_single_block_level_equals_exact_tome():
    config = dict(TINY_SD15, up_block_types=("UpBlock2D", "UpBlock2D"))  # one attention block at the top
    unet = build_unet(config)
    inputs = tiny_inputs(unet)
    outs = []
    for share in (False, True):
        backend = tome_backend(0.5, compiler="eager", seed=3, share_plan=share)
        model = torch.compile(copy.deepcopy(unet), backend=backend, fullgraph=True)
        outs.append([call(model, inputs) for _ in range(2)])
        assert len(backend.reports[0].rewritten) == 1
    for a, b in zip(*outs):
        assert torch.equal(a, b)


def test_share_plan_with_importance_in_one_graph(sd15):
    unet, inputs = sd15
    gm = dynamo_graph(unet, inputs)
    result = merge_self_attention(gm, ToMeConfig(ratio=0.5, method="importance", share_plan=True),
                                  in_graph_fallback=True)
    assert len(result.rewritten) == 3 and len(plan_nodes(gm, importance_or_tome_plan)) == 1
    key = next(s for s in result.inputs if s.draw == "dst_key")
    assert key.shape[1] == 179  # the pool of one block: int((256 - 128) * 1.4)
    backend = tome_backend(0.5, compiler="eager", method="importance", share_plan=True, seed=0)
    model = torch.compile(tiny_unet("sd15"), backend=backend, fullgraph=True)
    for t in (999, 900):
        inputs.timestep = torch.tensor(t)
        assert torch.isfinite(call(model, inputs)).all()
    assert [r.method for r in backend.reports] == ["tome", "importance"]


def test_shared_plan_export_equals_the_compiled_backend(tmp_path, sd15):
    from tome_compile.export import ToMeSession, export_onnx

    unet, inputs = sd15
    config = ToMeConfig(ratio=0.5, share_plan=True, seed=0)
    result = export_onnx(copy.deepcopy(unet), tmp_path / "shared.onnx", config, height=128, width=128, seq_len=7,
                         atol=1e-4, partition_input=True)
    assert result.parity_max_abs is not None and result.parity_max_abs <= 1e-4
    (spec,) = [s for s in result.report.inputs if s.draw == "partition"]
    assert spec.cells == ((8, 8),)  # one draw for the level, not three
    session = ToMeSession(result.path, seed=2)
    model = torch.compile(copy.deepcopy(unet), backend=tome_backend(config.replace(seed=2), compiler="eager"),
                          fullgraph=True)
    for _ in range(2):
        got = session(inputs.sample, inputs.timestep, inputs.encoder_hidden_states).sample
        assert (got - call(model, inputs)).abs().max() < 1e-4
