"""Plan reuse (issue #11): share_plan (one plan per resolution level per U-Net call) and
plan_every (plans kept across U-Net calls as graph state)."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
from conftest import TINY_SD15, call, dynamo_graph, tiny_inputs, tiny_unet, tomesd_reference
from tome_compile.passes.follow_up import either_plans, fallback_plans, keep_plans, reuse_plans

from tome_compile import ToMeConfig, generation, merge_self_attention, tome_backend
from tome_compile.errors import ToMeConfigError, ToMeRewriteError
from tome_compile.merge import tome_plan
from tome_compile.models import build_unet
from tome_compile.plans import importance_or_tome_plan, make_plan


def plan_nodes(gm, fn=tome_plan):
    if fn is tome_plan:  # the rewrite's ToMe plans: make_plan(method="tome")
        return [n for n in gm.graph.nodes if n.op == "call_function" and n.target is make_plan
                and n.kwargs.get("method") == "tome"]
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
    assert reasons["up_blocks.1.attentions.1.transformer_blocks.0.attn1"].endswith(
        f"plan shared from {maker}"
    )
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


def test_shared_plan_equals_tomesd_with_its_plan_cached_per_token_count(sd15, monkeypatch):
    """The reference for share_plan: tomesd whose compute_merge is made once per token count per
    U-Net call (at the first block of that count) and handed to the later blocks unchanged."""
    import tomesd.merge
    import tomesd.patch

    unet, inputs = sd15
    made: dict[int, tuple] = {}
    compute_merge = tomesd.patch.compute_merge

    def once_per_token_count(x, tome_info):
        if x.shape[1] not in made:
            made[x.shape[1]] = compute_merge(x, tome_info)
        return made[x.shape[1]]

    ref = tomesd_reference(unet, ratio=0.5, use_rand=False)
    ref.register_forward_pre_hook(lambda *args: made.clear())
    monkeypatch.setattr(tomesd.patch, "compute_merge", once_per_token_count)
    expected = call(ref, inputs)
    assert sorted(made) == [64, 256]  # tomesd asks at every block; only the 256-token one merges
    assert made[64][0] is tomesd.merge.do_nothing and made[256][0] is not tomesd.merge.do_nothing
    monkeypatch.undo()
    model = torch.compile(copy.deepcopy(unet), backend=tome_backend(0.5, compiler="eager", use_rand=False,
                                                                    share_plan=True), fullgraph=True)
    got = call(model, inputs)
    assert (got - expected).abs().max() < 1e-5
    # negative: plain tomesd (a plan per block) is not what share_plan computes
    assert (got - call(tomesd_reference(unet, ratio=0.5, use_rand=False), inputs)).abs().max() > 1e-3


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
    for a, b in zip(*outs, strict=True):
        assert torch.equal(a, b)


def test_share_plan_with_importance_in_one_graph(sd15):
    unet, inputs = sd15
    gm = dynamo_graph(unet, inputs)
    result = merge_self_attention(gm, ToMeConfig(ratio=0.5, method="importance", share_plan=True))
    result = fallback_plans(gm, result)
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
    result = export_onnx(
        copy.deepcopy(unet),
        tmp_path / "shared.onnx",
        config,
        height=128,
        width=128,
        seq_len=7,
        atol=1e-4,
        partition_input=True,
    )
    assert result.parity_max_abs is not None and result.parity_max_abs <= 1e-4
    (spec,) = [s for s in result.report.inputs if s.draw == "partition"]
    assert spec.cells == ((8, 8),)  # one draw for the level, not three
    session = ToMeSession(result.path, seed=2)
    model = torch.compile(copy.deepcopy(unet), backend=tome_backend(config.replace(seed=2), compiler="eager"),
                          fullgraph=True)
    for _ in range(2):
        got = session(inputs.sample, inputs.timestep, inputs.encoder_hidden_states).sample
        assert (got - call(model, inputs)).abs().max() < 1e-4


# --- plan_every (issue #11, second part) --------------------------------------------------------

class KindCounter:
    """Inner compiler that records which graph each call runs: "make" (returns its plans),
    "reuse" (reads them) or "plain"."""

    def __init__(self) -> None:
        self.compiled: list[str] = []
        self.runs: list[str] = []

    def __call__(self, gm, example_inputs):
        names = [n.name for n in gm.graph.nodes if n.op == "placeholder"]
        outputs = next(n for n in gm.graph.nodes if n.op == "output").args[0]
        kind = ("reuse" if "tome_plan_slots" in names else
                "make" if any(getattr(o, "meta", {}).get("tome", {}).get("role") == "state" for o in outputs)
                else "plain")
        self.compiled.append(kind)

        def run(*args):
            self.runs.append(kind)
            return gm.forward(*args)
        return run


def test_plan_every_state_is_a_graph_output_fed_back_as_an_input(sd15):
    from tome_compile.plans import pack_plans, plan_or_reuse, unpack_plan

    unet, inputs = sd15
    config = ToMeConfig(ratio=0.5, plan_every=2, max_downsample=2)
    def composed(form, config):  # the canonical pass, then a follow-up pass: the deployment form
        gm = dynamo_graph(unet, inputs)
        return form(gm, merge_self_attention(gm, config))

    make = composed(keep_plans, config)
    assert len(make.rewritten) == 4 and len(plan_nodes(make.graph_module)) == 4
    assert [s.name for s in make.outputs] == ["tome_plan_slots_out", "tome_plan_weights_out"]
    assert make.outputs[0].shape == (2 * (3 * 256 + 64),)  # every block's slot per image, flat
    assert make.outputs[1].shape == (2 * (3 * 128 + 32),)  # its N - r weights
    assert len(plan_nodes(make.graph_module, pack_plans)) == 1
    out = next(n for n in make.graph_module.graph.nodes if n.op == "output").args[0]
    assert len(out) == 3  # the model's output, then the plans
    assert all("plan kept for the next calls (plan_every=2)" in s.reason for s in make.rewritten)

    reuse = composed(reuse_plans, config)
    assert reuse.input_names == ["tome_plan_slots", "tome_plan_weights"]  # nothing drawn: no partition
    assert not plan_nodes(reuse.graph_module) and len(plan_nodes(reuse.graph_module, unpack_plan)) == 4
    assert reuse.count_nodes("merge") == 4 and reuse.count_nodes("unmerge") == 4 and not reuse.outputs

    # share_plan + plan_every: the state holds one plan per level
    shared = composed(either_plans, config.replace(share_plan=True))
    assert len(plan_nodes(shared.graph_module, plan_or_reuse)) == 2
    assert shared.input_names == ["tome_partition", "tome_plan_slots", "tome_plan_weights", "tome_reuse_plan"]
    assert shared.outputs[0].shape == (2 * (256 + 64),)

    # negative: the canonical pass alone has no state, and a second plan-state form is refused
    plain = merge_self_attention(dynamo_graph(unet, inputs), config)
    assert not plain.outputs and "tome_plan_slots" not in plain.input_names and plain.plan_state is None
    with pytest.raises(ToMeRewriteError, match="already has plan state"):
        reuse_plans(reuse.graph_module, reuse)


@pytest.mark.parametrize("method", ["tome", "importance"])
def test_plan_every_recomputes_exactly_every_k_calls(sd15, method):
    unet, inputs = sd15
    counter = KindCounter()
    backend = tome_backend(0.5, compiler=counter, seed=1, plan_every=3, method=method)
    model = torch.compile(copy.deepcopy(unet), backend=backend, fullgraph=True)
    exact = torch.compile(
        copy.deepcopy(unet),
        backend=tome_backend(0.5, compiler="eager", seed=1, method=method),
        fullgraph=True,
    )
    rng = torch.get_rng_state()
    outs, refs = [], []
    for t in (999, 950, 900, 850, 800, 750, 700):
        inputs.timestep = torch.tensor(t)
        outs.append(call(model, inputs))
        refs.append(call(exact, inputs))
    if method == "tome":
        assert counter.runs == ["make", "reuse", "reuse", "make", "reuse", "reuse", "make"]
    else:  # the fallback step plans; the first step with a map plans afresh (a new kind of plan)
        assert counter.runs == ["make", "make", "reuse", "reuse", "make", "reuse", "reuse"]
    assert sorted(set(counter.compiled)) == ["make", "reuse"]  # all compiled at the first call ...
    compiled = len(counter.compiled)
    assert compiled == (2 if method == "tome" else 3)
    first_reuse = counter.runs.index("reuse")
    for i in range(first_reuse):
        assert torch.equal(outs[i], refs[i])  # planning calls before any reuse are exact ToMe
    assert not torch.equal(outs[first_reuse], refs[first_reuse])  # a reusing call merges with the older plan
    assert torch.equal(torch.get_rng_state(), rng)  # the global RNG is never touched

    # a new generation (the timestep goes back up) plans at once, though the plan is young
    inputs.timestep = torch.tensor(999)
    call(model, inputs)
    inputs.timestep = torch.tensor(990)
    call(model, inputs)
    assert counter.runs[-2:] == ["make", "reuse" if method == "tome" else "make"]
    backend.reset()
    call(model, inputs)
    assert counter.runs[-1] == "make"
    assert len(counter.compiled) == compiled  # ... and never again: no recompile over the steps


def test_a_reused_plan_is_the_plan_of_its_planning_call(sd15):
    unet, inputs = sd15
    backend = tome_backend(0.5, compiler="eager", seed=0, plan_every=2)
    model = torch.compile(copy.deepcopy(unet), backend=backend, fullgraph=True)
    with generation():  # one generation: a call at the same timestep again is its second call
        first = call(model, inputs)
        state = backend.call_state()
        slots = state.plans[0].clone()
        again = call(model, inputs)  # same inputs, reused plan: the same output, bit for bit
        assert torch.equal(first, again) and torch.equal(state.plans[0], slots) and state.plan_age == 2
        moved = copy.copy(inputs)
        moved.sample = inputs.sample.flip(-1)
        fresh = call(model, moved)  # plan_age reached 2: this call plans on the new latent
        assert state.plans_made == 2 and not torch.equal(state.plans[0], slots)
    exact = torch.compile(
        copy.deepcopy(unet), backend=tome_backend(0.5, compiler="eager", seed=0), fullgraph=True
    )
    with generation():
        call(exact, inputs)  # advance exact's sampler past its first draw (the second reused call drew none)
        assert torch.equal(fresh, call(exact, moved))


@pytest.mark.parametrize("value", [0, -1, 1.5, True, "2"])
def test_plan_every_must_be_a_positive_int(value):
    with pytest.raises(ToMeConfigError, match="plan_every"):
        ToMeConfig(plan_every=value)


@pytest.mark.parametrize("method, optimize", [("tome", "cpu"), ("importance", None)])
def test_plan_every_export_equals_the_compiled_backend_call_by_call(tmp_path, sd15, method, optimize):
    """ToMe's file also goes through ORT's transformer optimizer, whose shape inference has to work
    through the If subgraphs: the same fusions as the plain ToMe export, and every call still equals
    the compiled backend."""
    from tome_compile.export import ToMeSession, export_onnx

    unet, inputs = sd15
    config = ToMeConfig(ratio=0.5, plan_every=2, seed=0, method=method)
    result = export_onnx(
        copy.deepcopy(unet),
        tmp_path / "every.onnx",
        config,
        height=128,
        width=128,
        seq_len=7,
        atol=1e-4,
        partition_input=True,
        optimize=optimize,
    )
    assert result.parity_max_abs is not None and result.parity_max_abs <= 1e-4  # both branches checked
    if optimize:
        assert result.fusions == {"LayerNormalization": 4, "MultiHeadAttention": 8,
                                  "SkipLayerNormalization": 8}
    assert {"tome_plan_slots", "tome_plan_weights", "tome_reuse_plan"} <= set(result.optional_inputs)
    session = ToMeSession(result.path, seed=4)
    assert session.driver.plan_every == 2
    backend = tome_backend(config.replace(seed=4), compiler="eager")
    model = torch.compile(copy.deepcopy(unet), backend=backend, fullgraph=True)
    made = []
    for t in (999, 900, 800, 700, 600, 999, 900):
        inputs.timestep = torch.tensor(t)
        got = session(inputs.sample, inputs.timestep, inputs.encoder_hidden_states).sample
        assert (got - call(model, inputs)).abs().max() < 1e-4
        made.append((session.importance.plans_made, backend.importance.plans_made))
    assert all(a == b for a, b in made)
    assert made[-1][0] == (4 if method == "tome" else 5)


def test_plan_every_export_runs_with_standard_inputs_only(tmp_path, sd15):
    import onnxruntime as ort
    from tome_compile.export import ToMeSession, export_onnx

    unet, inputs = sd15
    result = export_onnx(copy.deepcopy(unet), tmp_path / "every.onnx", ToMeConfig(ratio=0.5, plan_every=3),
                         height=128, width=128, seq_len=7, atol=1e-4)
    session = ort.InferenceSession(str(result.path), providers=["CPUExecutionProvider"])
    assert [o.name for o in session.get_outputs()] == [
        "out_sample",
        "tome_plan_slots_out",
        "tome_plan_weights_out",
    ]
    feed = {"sample": inputs.sample[:1].numpy(), "timestep": np.array([999.0], dtype=np.float32),
            "encoder_hidden_states": inputs.encoder_hidden_states[:1].numpy()}
    out, slots, weights = session.run(None, feed)  # a client that knows nothing of ToMe: plans every call
    assert out.shape == (1, 4, 16, 16) and slots.shape == (3 * 256,) and weights.shape == (3 * 128,)
    tome = ToMeSession(result.path)  # the hashed destinations from tome_seed 0 and the timestep
    ours = tome(inputs.sample[:1], torch.tensor(999), inputs.encoder_hidden_states[:1]).sample
    assert np.abs(ours.numpy() - out).max() < 1e-5
    # fed back, the plans are reused: the same latent gives the same output
    again = session.run(None, {**feed, "tome_plan_slots": slots, "tome_plan_weights": weights,
                               "tome_reuse_plan": np.array(True)})[0]
    assert np.array_equal(again, out)
    other = session.run(
        None,
        {
            **feed,
            "tome_plan_slots": slots,
            "tome_plan_weights": weights,
            "tome_reuse_plan": np.array(True),
            "timestep": np.array([500.0], dtype=np.float32),
        },
    )
    replanned = session.run(None, {**feed, "timestep": np.array([500.0], dtype=np.float32)})
    assert np.array_equal(other[1], slots)  # reusing returns the plans it was given ...
    assert not np.array_equal(replanned[1], slots)  # ... planning at another step makes new ones
    assert not np.array_equal(other[0], replanned[0])


def test_subgraph_shape_inference_copies_only_what_the_subgraph_reads():
    """The work-around for ORT's shape inference copying every initializer per If subgraph (> 20 GB
    on SD 1.5): the subgraph's temporary model holds the initializers it reads, not the others."""
    import onnx
    import onnxruntime.transformers.optimizer  # noqa: F401  (puts ORT's helper modules on sys.path)
    from onnx import TensorProto, helper, numpy_helper
    from shape_infer_helper import SymbolicShapeInferenceHelper
    from tome_compile.export.ort_optimizer import _subgraph_inference_reads_what_it_uses

    def branch(name, node):
        return helper.make_graph(
            [node], name, [], [helper.make_tensor_value_info("y_" + name, TensorProto.FLOAT, None)]
        )
    then = branch("then", helper.make_node("Add", ["x", "c"], ["y_then"]))
    other = branch("else", helper.make_node("Identity", ["x"], ["y_else"]))
    graph = helper.make_graph(
        [helper.make_node("If", ["cond"], ["y"], then_branch=then, else_branch=other)], "g",
        [helper.make_tensor_value_info("cond", TensorProto.BOOL, []),
         helper.make_tensor_value_info("x", TensorProto.FLOAT, [2])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
        [numpy_helper.from_array(np.ones(2, np.float32), "c"),
         numpy_helper.from_array(np.zeros(1000, np.float32), "weights_nobody_reads")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 20)])

    def subgraph_initializers(patched: bool) -> set[str]:
        with _subgraph_inference_reads_what_it_uses(patched) as active:
            assert active == patched
            shapes = SymbolicShapeInferenceHelper(onnx.ModelProto.FromString(model.SerializeToString()))
            assert shapes.infer({})
            assert shapes.get_edge_shape("y") == [2]
        return {i.name for i in shapes.tmp_mp_.graph.initializer}

    assert subgraph_initializers(True) == set()  # the last branch inferred (Identity) reads no weight
    assert subgraph_initializers(False) == {"c", "weights_nobody_reads"}  # ORT as shipped: all of them
