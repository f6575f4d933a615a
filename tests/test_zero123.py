"""Issue #22: multi-view (Zero123++) — reference attention. The wrapper runs its U-Net twice per call
(write pass over the noised condition latent, read pass over the tiled views); the pass merges the
read pass's view tokens (queries and the self part of keys/values), keeps the reference tokens
whole, and leaves the write pass alone. Compiled as users compile it: the whole wrapper."""

from __future__ import annotations

import copy

import pytest
import torch
from zero123_reference import tiny_zero123, tiny_zero123_inputs, tomesd_reference

from tome_compile import generation, tome_backend
from tome_compile.guidance import importance_map

READ_SITES = ["unet.down_blocks.0.attentions.0.transformer_blocks.0.attn1",
              "unet.up_blocks.1.attentions.0.transformer_blocks.0.attn1",
              "unet.up_blocks.1.attentions.1.transformer_blocks.0.attn1"]


@pytest.fixture(scope="module")
def zero123():
    return tiny_zero123(), tiny_zero123_inputs()


def run(model, inputs, timesteps, seed=1):
    """The wrapper called as the pipeline calls it, one call per timestep (the global RNG seeded
    first: the wrapper draws the condition latent's noise from it)."""
    sample, kwargs = inputs
    torch.manual_seed(seed)
    outs = []
    with torch.no_grad():
        for t in timesteps:
            outs.append(model(sample, torch.tensor(t), **kwargs).sample)
    return outs


def unet_report(backend):
    """The report of the graph that holds the U-Net passes (the scheduler's graph breaks make others)."""
    return next(r for r in backend.reports if r.sites)


def test_the_read_pass_is_merged_and_the_write_pass_left_alone(zero123):
    wrapper, inputs = zero123
    backend = tome_backend(0.5, compiler="eager", use_rand=False)
    run(torch.compile(copy.deepcopy(wrapper), backend=backend), inputs, [999])
    report = unet_report(backend)
    assert [s.path for s in report.rewritten] == READ_SITES
    assert all(s.kind == "self-attention + reference" and s.tokens == 96 and s.tokens_after == 48
               and s.reason.endswith("; 16 reference tokens kept") for s in report.rewritten)
    writes = [s for s in report.sites if s.kind == "self-attention"]
    assert len(writes) == 4 and all("reference pass" in s.reason and not s.rewritten for s in writes)
    assert all(not s.rewritten for s in report.sites if s.kind == "cross-attention")
    assert report.count_nodes("merge") == report.count_nodes("unmerge") == 3
    line = next(s.line() for s in report.rewritten)
    assert "self-attention + reference  96 -> 48 tokens  rewritten [attn1]" in line


@pytest.mark.parametrize("use_rand", [False, True])
def test_equals_tomesd_on_the_view_tokens_of_the_read_pass(zero123, use_rand):
    wrapper, inputs = zero123
    model = torch.compile(copy.deepcopy(wrapper), backend=tome_backend(0.5, compiler="eager", use_rand=use_rand,
                                                                        seed=3))
    reference = tomesd_reference(wrapper, ratio=0.5, use_rand=use_rand)
    if use_rand:
        reference.unet._tome_info["args"]["generator"] = torch.Generator().manual_seed(3)
    with generation():
        ours = run(model, inputs, [999, 749, 499])
    expected = run(reference, inputs, [999, 749, 499])
    plain = run(wrapper, inputs, [999, 749, 499])
    for a, b, p in zip(ours, expected, plain, strict=True):
        assert (a - b).abs().max() < 1e-5
        assert (a - p).abs().max() > 1e-3  # merging changed the output


def test_ratio_zero_is_bit_identical_and_tome_adds_no_break_recompile_or_draw(zero123):
    from torch._dynamo.utils import counters

    wrapper, inputs = zero123
    eager = run(wrapper, inputs, [999, 749, 499])
    rng_eager = torch.get_rng_state()
    counters.clear()
    zero = run(torch.compile(copy.deepcopy(wrapper), backend=tome_backend(0.0, compiler="eager")), inputs,
               [999, 749, 499])
    assert all(torch.equal(a, b) for a, b in zip(zero, eager, strict=True))
    plain_counts = (sum(counters["graph_break"].values()), counters["stats"]["unique_graphs"])
    torch._dynamo.reset()
    counters.clear()
    run(torch.compile(copy.deepcopy(wrapper), backend=tome_backend(0.5, compiler="eager", seed=0)), inputs,
        [999, 749, 499])
    assert (sum(counters["graph_break"].values()), counters["stats"]["unique_graphs"]) == plain_counts
    assert torch.equal(torch.get_rng_state(), rng_eager)  # randn_like: the wrapper's draws, nothing more


def test_importance_uses_the_tiled_views_map_and_plans_are_reused(zero123):
    wrapper, inputs = zero123
    backend = tome_backend(0.5, compiler="eager", method="importance", plan_every=2, seed=0)
    outs = run(torch.compile(copy.deepcopy(wrapper), backend=backend), inputs, [999, 749, 499, 249])
    methods = [r.method for r in backend.reports if r.sites]
    assert methods[:2] == ["tome", "importance"]  # the fallback graph and the importance graph
    state = backend.call_state()
    assert state.calls == 4 and state.generations == 1
    assert state.map.shape == (1, 12, 8)  # one map per CFG pair over the 12 x 8 tiled latent
    assert torch.allclose(state.map, importance_map(outs[-1]))
    assert state.plans_made == 3  # fallback step plans; first step with a map plans afresh; then every 2
