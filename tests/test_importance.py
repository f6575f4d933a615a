"""Importance-based merging: fixed-shape math vs the loop reference, runtime state, compiled path."""

from __future__ import annotations

import copy

import pytest
import torch
from conftest import call, tiny_inputs, tiny_unet
from importance_reference import reference_merge_unmerge

from tome_compile import ToMeConfig, ToMeConfigError, tome_backend
from tome_compile.guidance import GUIDANCE, importance_map
from tome_compile.merge import (
    fit_importance,
    importance_partition,
    importance_plan,
    importance_pool_size,
    merge_tokens,
    unmerge_tokens,
)


@pytest.mark.parametrize("pairs, h, w, ratio", [(1, 8, 8, 0.5), (2, 7, 9, 0.3), (1, 10, 10, 0.7)])
@pytest.mark.parametrize("random_dst", [True, False])
def test_plan_equals_loop_reference(pairs, h, w, ratio, random_dst):
    g = torch.Generator().manual_seed(pairs * 100 + h)
    n = h * w
    metric = torch.randn(2 * pairs, n, 6, generator=g)
    x = torch.randn(2 * pairs, n, 5, generator=g)
    importance = torch.rand(pairs, h, w, generator=g)
    r = int(n * ratio)
    m = importance_pool_size(n, r, 1.4, 0.25)
    key = torch.rand(pairs, m, generator=g) if random_dst else None
    slot, weight = importance_plan(metric, importance, key, h, w, r, 1.4, 0.25)
    merged = merge_tokens(x, slot, weight)
    ref_rows, ref_out = reference_merge_unmerge(metric, x, importance, key, r)
    assert merged.shape == (2 * pairs, n - r, 5)
    assert (unmerge_tokens(merged, slot) - ref_out).abs().max() <= 1e-5
    for image, rows in enumerate(ref_rows):
        assert torch.allclose(merged[image].sort(dim=0).values, rows.sort(dim=0).values, atol=1e-5)


def test_pairs_share_the_partition():
    g = torch.Generator().manual_seed(0)
    metric = torch.randn(4, 64, 8, generator=g)  # different metrics in every image
    importance = torch.rand(2, 8, 8, generator=g)
    key = torch.rand(2, importance_pool_size(64, 32, 1.4, 0.25), generator=g)
    slot, _ = importance_plan(metric, importance, key, 8, 8, 32, 1.4, 0.25)
    dst, _, _ = importance_partition(importance, key, 64, 32, 1.4, 0.25)
    kept = 64 - 16 - 32
    for pair in range(2):
        expected = torch.arange(kept, kept + 16)
        assert torch.equal(slot[pair, dst[pair]], expected)  # uncond half
        assert torch.equal(slot[pair + 2, dst[pair]], expected)  # cond half: the same destinations
    assert not torch.equal(slot[0], slot[2])  # ...while each image merges its own sources


def test_unimportant_tokens_are_all_merged():
    g = torch.Generator().manual_seed(1)
    n, r = 64, 40
    importance = torch.rand(1, 8, 8, generator=g)
    slot, _ = importance_plan(torch.randn(2, n, 4, generator=g), importance, None, 8, 8, r, 1.4, 0.25)
    m = importance_pool_size(n, r, 1.4, 0.25)
    unimportant = importance.reshape(-1).argsort(descending=True)[m:]
    kept = n - int(n * 0.25) - r
    assert bool((slot[:, unimportant] >= kept).all())  # in a destination slot, i.e. merged


def test_fit_importance_area():
    imp = torch.arange(16.0).view(1, 4, 4)
    assert torch.equal(fit_importance(imp, 4, 4), imp)
    assert fit_importance(imp, 2, 2).tolist() == [[[2.5, 4.5], [10.5, 12.5]]]


def test_importance_map_and_driver_state():
    from tome_compile.state import CallDriver

    eps = torch.randn(4, 3, 5, 5)
    assert torch.allclose(importance_map(eps), (eps[2:] - eps[:2]).abs().mean(1))
    driver = CallDriver(seed=0)

    def step(shape, t, out):
        call = driver.begin(None, shape, torch.tensor(t), layout=GUIDANCE["cfg"], keeps_plans=False)
        driver.finish(call, out, None)
        return call

    assert step((4, 3, 5, 5), 999, eps).map is None  # first call: no map
    used = step((4, 3, 5, 5), 980, eps)  # next step uses it
    assert used.kind == "importance" and torch.equal(used.map, importance_map(eps))
    assert step((4, 3, 5, 5), 999, eps).map is None  # timestep went up: new generation
    assert step((4, 3, 6, 6), 10, eps[:3]).map is None  # new shape: new generation
    assert driver.state().map is None  # odd batch: no CFG pair, no map


def test_invalid_importance_settings():
    with pytest.raises(ToMeConfigError, match="pool"):
        ToMeConfig(method="importance", ratio=0.85, sx=4, sy=4)
    with pytest.raises(ToMeConfigError, match="dst_fraction"):
        ToMeConfig(method="importance", dst_fraction=0.0)
    ToMeConfig(method="importance", ratio=0.82, sx=4, sy=4)  # (1 - 0.82) * 1.4 = 0.252 >= 0.25


class RecordingCompiler:
    """Eager inner compiler that records the ToMe inputs of every call, per compiled graph."""

    def __init__(self):
        self.graphs = []

    def __call__(self, gm, example_inputs):
        names = [n.name for n in gm.graph.nodes if n.op == "placeholder"]
        record = {"names": names, "calls": []}
        self.graphs.append(record)

        def run(*args):
            record["calls"].append({k: v for k, v in zip(names, args, strict=True) if k.startswith("tome_")})
            return gm.forward(*args)

        return run


def test_compiled_steps_fallback_map_lag_and_reset():
    unet = tiny_unet("sd15")
    inputs = tiny_inputs(unet)
    recorder = RecordingCompiler()
    backend = tome_backend(0.5, compiler=recorder, method="importance", seed=7)
    model = torch.compile(copy.deepcopy(unet), backend=backend, fullgraph=True)
    plain_tome = torch.compile(copy.deepcopy(unet), backend=tome_backend(0.5, compiler="eager", seed=7),
                               fullgraph=True)
    assert len(recorder.graphs) == 0
    outs = []
    for step, t in enumerate([999, 900, 800]):
        inputs.timestep = torch.tensor(t)
        outs.append(call(model, inputs))
        if step == 0:  # no map yet: the step is plain ToMe (same seed, same partition)
            assert torch.equal(outs[0], call(plain_tome, inputs))
    tome_graph, imp_graph = recorder.graphs  # compiled once each, before the first step
    assert "tome_partition" in tome_graph["names"] and "tome_importance" in imp_graph["names"]
    assert len(tome_graph["calls"]) == 1 and len(imp_graph["calls"]) == 2
    for k in (0, 1):  # the map used at step k+1 is the one step k produced
        used = imp_graph["calls"][k]["tome_importance"]
        assert torch.allclose(used, importance_map(outs[k]))
    backend.reset()
    inputs.timestep = torch.tensor(700)
    call(model, inputs)
    assert len(tome_graph["calls"]) == 2  # after reset: ToMe fallback again
    inputs.timestep = torch.tensor(999)  # timestep jumps up: a new generation, fallback again
    call(model, inputs)
    assert len(tome_graph["calls"]) == 3 and len(imp_graph["calls"]) == 2


def test_pipeline_end_to_end_without_recompiles():
    from conftest import tiny_pipeline
    from diffusers import StableDiffusionPipeline
    from torch._dynamo.utils import counters

    pipe = tiny_pipeline(StableDiffusionPipeline, tiny_unet("sd15"))
    backend = tome_backend(0.5, compiler="eager", method="importance", seed=0)
    pipe.unet = torch.compile(pipe.unet, backend=backend, fullgraph=True)
    g = torch.Generator().manual_seed(0)
    counters.clear()
    image = pipe(prompt_embeds=torch.randn(1, 7, 32, generator=g),
                 negative_prompt_embeds=torch.zeros(1, 7, 32), num_inference_steps=4, guidance_scale=7.5,
                 height=16, width=16, output_type="latent", generator=g).images
    assert image.shape == (1, 4, 2, 2) or image.shape[0] == 1
    assert counters["stats"]["unique_graphs"] == 1  # one Dynamo graph, no recompiles
    assert sum(counters["graph_break"].values()) == 0
    assert backend.importance.calls == 4 and backend.importance.map is not None
    assert [r.method for r in backend.reports] == ["tome", "importance"]


@pytest.mark.parametrize("batch", [2, 6])
def test_importance_under_inductor_equals_eager_graphs(batch):
    """Batch 6 is three images with CFG (#32): under inductor its 3-row map and keys made Dynamo
    fail building its guards (their sizes became symbols with no source) and, once past that, the
    compiled graph refused the drawn keys (one row expanded: stride 0). Batch 2 never showed either."""
    unet = tiny_unet("sd15")
    inputs = tiny_inputs(unet, batch=batch)
    eager = torch.compile(copy.deepcopy(unet), fullgraph=True,
                          backend=tome_backend(0.5, compiler="eager", method="importance", seed=3))
    backend = tome_backend(0.5, method="importance", seed=3)  # compiler="inductor"
    compiled = torch.compile(copy.deepcopy(unet), backend=backend, fullgraph=True)
    for t in (999, 900, 800):
        inputs.timestep = torch.tensor(t)
        assert (call(compiled, inputs) - call(eager, inputs)).abs().max() < 1e-4
    assert backend.importance.calls == 3 and [r.method for r in backend.reports] == ["tome", "importance"]
    assert backend.reports[1].inputs[0].shape[0] == batch // 2  # one map per image
    assert backend.driver.calls_by_kind["importance"] == 2
