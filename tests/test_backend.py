"""tome_backend under torch.compile: parity with tomesd, RNG hygiene, recompiles, warnings."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from conftest import CountingCompiler, call, compiled, tiny_inputs, tiny_unet, tomesd_reference

from tome_compile import ToMeWarning, generation, tome_backend


@pytest.mark.parametrize("kind, options, sites", [
    ("sd15", dict(), 3),
    ("sd15", dict(merge_crossattn=True), 6),  # the 3 blocks' attn2 run on the merged tokens too
    ("sd15", dict(merge_mlp=True), 3),
    ("sd2", dict(), 3),
    ("sdxl", dict(max_downsample=2), 6),  # down_blocks.1 (2 layers) + up_blocks.1 (2 attentions x 2 layers)
])
@pytest.mark.parametrize("use_rand", [False, True])
def test_equals_tomesd(kind, options, sites, use_rand):
    unet = tiny_unet(kind)
    inputs = tiny_inputs(unet)
    model, backend = compiled(unet, ratio=0.5, use_rand=use_rand, seed=11, **options)
    ref = tomesd_reference(unet, seed=11 if use_rand else None, ratio=0.5, use_rand=use_rand, **options)
    with generation():  # two calls of one generation: the partition sequence advances on both sides
        for _ in range(2):
            out, expected = call(model, inputs), call(ref, inputs)
            assert (out - expected).abs().max() < 1e-4
    assert len(backend.reports) == 1 and len(backend.reports[0].rewritten) == sites
    assert (out - call(unet, inputs)).abs().max() > 1e-3  # ToMe did change something


def test_ratio_zero_is_bit_identical():
    unet = tiny_unet("sd15")
    inputs = tiny_inputs(unet)
    model, backend = compiled(unet, ratio=0.0)
    assert torch.equal(call(model, inputs), call(unet, inputs))
    assert backend.reports == []  # nothing to rewrite: the graph went to the compiler as is


def test_global_rng_untouched_and_seed_reproducible():
    unet = tiny_unet("sd15")
    inputs = tiny_inputs(unet)
    model_a, _ = compiled(unet, seed=5)
    model_b, _ = compiled(unet, seed=5)
    model_c, _ = compiled(unet, seed=6)
    torch.manual_seed(123)
    state = torch.get_rng_state()
    with generation():
        a = [call(model_a, inputs) for _ in range(2)]
    assert torch.equal(torch.get_rng_state(), state)
    with generation():
        b = [call(model_b, inputs) for _ in range(2)]
    c = call(model_c, inputs)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    assert not torch.equal(a[0], a[1])  # a new partition per call of a generation, as tomesd
    assert not torch.equal(a[0], c)
    # bare calls at the same timestep are 1-step generations: each starts the sequence again
    assert torch.equal(call(model_a, inputs), a[0]) and torch.equal(call(model_a, inputs), a[0])


def test_generator_argument():
    unet = tiny_unet("sd15")
    inputs = tiny_inputs(unet)
    backend = tome_backend(0.5, compiler="eager", generator=torch.Generator().manual_seed(9))
    model = torch.compile(copy.deepcopy(unet), backend=backend, fullgraph=True)
    ref = tomesd_reference(unet, seed=9, ratio=0.5)
    assert (call(model, inputs) - call(ref, inputs)).abs().max() < 1e-4


@pytest.mark.parametrize("batch, hw", [(1, (16, 16)), (3, (16, 16)), (2, (15, 13)), (2, (17, 18))])
def test_odd_sizes_and_batches(batch, hw):
    unet = tiny_unet("sd15")
    inputs = tiny_inputs(unet, batch=batch, hw=hw)
    model, backend = compiled(unet, seed=2)
    ref = tomesd_reference(unet, seed=2, ratio=0.5)
    assert (call(model, inputs) - call(ref, inputs)).abs().max() < 1e-4
    report = backend.reports[0]
    assert len(report.rewritten) == 3
    if batch % 2:  # odd batch: fixed destinations, like tomesd, and no partition input
        assert report.inputs == [] and "odd" in report.rewritten[0].reason


def test_no_recompiles_over_ten_calls():
    unet = tiny_unet("sd15")
    counter = CountingCompiler()
    model, backend = compiled(unet, compiler=counter, seed=1)
    for step in range(10):
        call(model, tiny_inputs(unet, seed=step))
    assert counter.calls == 1 and len(backend.reports) == 1


def test_new_resolution_recompiles_cleanly():
    unet = tiny_unet("sd15")
    counter = CountingCompiler()
    model, backend = compiled(unet, compiler=counter, use_rand=False)
    ref = tomesd_reference(unet, ratio=0.5, use_rand=False)
    for hw in [(16, 16), (24, 24), (20, 16), (24, 24)]:
        inputs = tiny_inputs(unet, hw=hw)
        assert (call(model, inputs) - call(ref, inputs)).abs().max() < 1e-4
    # Dynamo went dynamic after the first change; the backend specialises per resolution.
    assert [len(r.rewritten) for r in backend.reports] == [3, 3, 3]
    assert [r.rewritten[0].tokens for r in backend.reports] == [256, 576, 320]


def test_sdxl_at_max_downsample_1_warns_loudly():
    unet = tiny_unet("sdxl")
    model, backend = compiled(unet)
    with pytest.warns(ToMeWarning, match="max_downsample=2"):
        call(model, tiny_inputs(unet))
    assert backend.reports[0].rewritten == []


def test_no_warning_when_sites_are_rewritten():
    unet = tiny_unet("sd15")
    model, _ = compiled(unet)
    with warnings.catch_warnings():
        warnings.simplefilter("error", ToMeWarning)
        call(model, tiny_inputs(unet))


def test_backend_by_name():
    unet = tiny_unet("sd15")
    inputs = tiny_inputs(unet)
    model = torch.compile(copy.deepcopy(unet), backend="tome", fullgraph=True,
                          options={"ratio": 0.5, "use_rand": False, "compiler": "eager"})
    ref = tomesd_reference(unet, ratio=0.5, use_rand=False)
    assert (call(model, inputs) - call(ref, inputs)).abs().max() < 1e-4


def test_inductor_equals_tomesd_without_recompiles():
    unet = tiny_unet("sd15")
    inputs = tiny_inputs(unet)
    backend = tome_backend(0.5, seed=4)  # compiler="inductor"
    model = torch.compile(copy.deepcopy(unet), backend=backend, fullgraph=True)
    ref = tomesd_reference(unet, seed=4, ratio=0.5)
    from torch._dynamo.utils import counters

    counters.clear()
    for t in (999, 900, 800):  # bare calls of one generation (falling timesteps): one sequence, as tomesd
        inputs.timestep = torch.tensor(t)
        assert (call(model, inputs) - call(ref, inputs)).abs().max() < 1e-4
    assert counters["stats"]["unique_graphs"] == 1
    assert len(backend.reports) == 1 and len(backend.reports[0].rewritten) == 3
