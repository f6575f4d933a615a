"""tome-export's default file (one export, shared by the tests): ORT parity, sessions, any batch
and size, fp16, the ORT optimizer, the graph's structure, metadata."""


from __future__ import annotations

import copy

import numpy as np
import onnx
import pytest
import torch
from conftest import call, tiny_inputs
from export_helpers import (
    HW,
    _optimum_folder,
    attention_modules,
    made_before_the_blocks,
    ort_session,
    shared_merge_zeros,
    standard_feed,
)
from tome_compile.export import ToMeSession, check_op_inventory, export_onnx, lean_memory_options
from tome_compile.passes import SEED_INPUT

from tome_compile import ToMeConfig, ToMeError, ToMeExportError, tome_backend


@pytest.fixture(scope="module")
def exported(tmp_path_factory, unet):
    """The default export: fused attention, any batch, float timestep, hashed destinations."""
    out = tmp_path_factory.mktemp("onnx") / "unet.onnx"
    return export_onnx(
        copy.deepcopy(unet), out, ToMeConfig(ratio=0.5, seed=0), height=HW, width=HW, seq_len=7, atol=1e-4
    )


@pytest.fixture(scope="module")
def exported_partition(tmp_path_factory, unet):
    """--partition-input: the destinations drawn by the caller (bit-exact with tome_backend)."""
    out = tmp_path_factory.mktemp("onnx_partition") / "unet.onnx"
    return export_onnx(
        copy.deepcopy(unet),
        out,
        ToMeConfig(ratio=0.5, seed=0),
        height=HW,
        width=HW,
        seq_len=7,
        atol=1e-4,
        partition_input=True,
    )


def test_default_export_is_what_ort_users_deploy(exported, unet):
    from onnxruntime.tools.symbolic_shape_infer import SymbolicShapeInference

    assert exported.path.is_file() and exported.path.with_name("unet.onnx.data").is_file()
    assert exported.input_names == ["sample", "timestep", "encoder_hidden_states", "tome_seed"]
    assert exported.optional_inputs == ["tome_seed"]
    assert [s.path for s in exported.report.rewritten] == [
        "down_blocks.0.attentions.0.transformer_blocks.0.attn1",
        "up_blocks.1.attentions.0.transformer_blocks.0.attn1",
        "up_blocks.1.attentions.1.transformer_blocks.0.attn1"]
    assert exported.parity_max_abs is not None and exported.parity_max_abs <= 1e-4
    model = onnx.load(str(exported.path), load_external_data=False)
    ops = [(n.domain, n.op_type) for n in model.graph.node]
    # every attention of the U-Net (merged, unmerged, cross) is one fused node
    assert ops.count(("com.microsoft", "MultiHeadAttention")) == attention_modules(unet) == 8
    assert not any(op.startswith("Random") for _, op in ops)  # destinations hashed, not drawn
    assert not {"ReduceL2", "ReduceMax", "Softmax"} & {op for _, op in ops}  # shape inference reads all
    assert "GroupNormalization" not in {
        op for _, op in ops
    }  # opset 20: InstanceNormalization (CUDA EP has it)
    inputs = {i.name: i.type.tensor_type for i in model.graph.input}
    assert inputs["timestep"].elem_type == onnx.TensorProto.FLOAT
    assert [d.dim_value for d in inputs["timestep"].shape.dim] == [1]
    assert inputs["sample"].shape.dim[0].dim_param and inputs["encoder_hidden_states"].shape.dim[0].dim_param
    assert [i.name for i in model.graph.initializer if i.name.startswith("tome")] == ["tome_seed"]
    assert [o.name for o in model.graph.output] == ["out_sample"]
    assert check_op_inventory(exported.path).ok
    inferred = SymbolicShapeInference.infer_shapes(onnx.load(str(exported.path)), auto_merge=True)
    assert inferred is not None


def test_any_batch_with_standard_inputs_only(exported, exported_partition):
    from tome_compile.sampler import hashed_partition

    hashed, drawn = ort_session(exported.path), ort_session(exported_partition.path)
    cells = sum(a * b for a, b in next(s for s in exported_partition.report.inputs).cells)
    for batch in (1, 2, 4):
        feed = standard_feed(batch)
        got = hashed.run(None, feed)[0]  # tome_seed omitted: its default, 0
        assert got.shape == feed["sample"].shape
        # the graph's destinations are hashed_partition(seed, timestep): fed to the partition
        # export (== tome_backend with that partition) they give the same output
        partition = hashed_partition(torch.tensor(0), torch.tensor([999.0]), cells, 4).numpy()
        ref = drawn.run(None, {**feed, "tome_partition": partition})[0]
        assert np.abs(got - ref).max() < 1e-5
        assert np.array_equal(got, hashed.run(None, {**feed, "tome_seed": np.array(0)})[0])


def test_tome_seed_changes_the_output(exported):
    session, feed = ort_session(exported.path), standard_feed(2)
    a = session.run(None, {**feed, "tome_seed": np.array(0)})[0]
    b = session.run(None, {**feed, "tome_seed": np.array(7)})[0]
    assert np.abs(a - b).max() > 1e-3


def test_session_equals_compiled_backend(exported_partition, unet):
    # Same seed => same partition sequence => the ONNX and torch.compile paths agree call by call.
    session = ToMeSession(exported_partition.path, seed=3)
    assert session.provider == "CPUExecutionProvider"
    backend = tome_backend(0.5, compiler="eager", seed=3)
    compiled = torch.compile(copy.deepcopy(unet), backend=backend, fullgraph=True)
    inputs = tiny_inputs(unet)
    for _ in range(2):
        got = session(
            inputs.sample, inputs.timestep, encoder_hidden_states=inputs.encoder_hidden_states
        ).sample
        assert (got - call(compiled, inputs)).abs().max() < 1e-4
    tuple_out = session(inputs.sample, inputs.timestep, inputs.encoder_hidden_states, return_dict=False)
    assert isinstance(tuple_out, tuple) and tuple_out[0].shape == inputs.sample.shape


@pytest.mark.parametrize("timestep", [999, 999.0, torch.tensor(999), torch.tensor([999.0]),
                                      torch.tensor([999, 999])])
def test_session_takes_every_timestep_form(exported, unet, timestep):
    session = ToMeSession(exported.path, seed=0)
    inputs = tiny_inputs(unet)
    got = session(inputs.sample, timestep, inputs.encoder_hidden_states).sample
    feed = {"sample": inputs.sample.numpy(), "timestep": np.array([999.0], np.float32),
            "encoder_hidden_states": inputs.encoder_hidden_states.numpy()}
    assert np.array_equal(got.numpy(), ort_session(exported.path).run(None, feed)[0])


def test_session_rejects_wrong_shapes(exported, exported_partition):
    session = ToMeSession(exported.path, seed=0)
    # any size, but in multiples of the U-Net's downsampling (the tiny U-Net: 2)
    with pytest.raises(ToMeExportError, match="multiples of 2 .*images in multiples of 16 pixels"):
        session(torch.zeros(2, 4, 9, 8), torch.tensor(1), torch.zeros(2, 7, 32))
    with pytest.raises(ToMeExportError, match="fixed per export"):  # --partition-input keeps its size
        ToMeSession(exported_partition.path, seed=0)(torch.zeros(2, 4, 8, 8), torch.tensor(1),
                                                      torch.zeros(2, 7, 32))
    with pytest.raises(ToMeExportError, match="different values"):
        session(torch.zeros(2, 4, 16, 16), torch.tensor([1, 2]), torch.zeros(2, 7, 32))


def test_session_plans_lean_memory_on_the_cpu_ep(exported):
    """ToMeSession's CPU default is lean_memory_options (every value its own buffer: ORT's reuse
    plan held 1.55 GB at the peak of an SD 1.5 call where the live values are 0.22 GB), the same
    numbers as ORT's own plan; options the caller gives are used as given."""
    import onnxruntime as ort

    lean = ToMeSession(exported.path, providers=["CPUExecutionProvider"], seed=0)
    options = lean.session.get_session_options()
    assert not options.enable_mem_reuse and not options.enable_mem_pattern
    given = ToMeSession(exported.path, providers=["CPUExecutionProvider"], seed=0,
                        session_options=ort.SessionOptions())
    assert given.session.get_session_options().enable_mem_reuse  # negative: the caller's, untouched
    feed = standard_feed(2)
    args = (feed["sample"], feed["timestep"], feed["encoder_hidden_states"])
    assert np.array_equal(lean(*args), given(*args))
    assert lean_memory_options(ort.SessionOptions()).enable_mem_reuse is False


def test_fp16_export_runs_on_the_cpu_ep(tmp_path, unet, exported):
    result = export_onnx(copy.deepcopy(unet), tmp_path / "h.onnx", ToMeConfig(ratio=0.5, seed=0), height=HW,
                         width=HW, seq_len=7, fp16=True)
    assert result.parity_provider == "CPUExecutionProvider"  # checked vs PyTorch fp16, not skipped
    assert result.parity_max_rel is not None and result.parity_max_rel < 1e-2
    model = onnx.load(str(result.path), load_external_data=False)
    scatters = [n for n in model.graph.node if n.op_type == "ScatterElements"]
    assert scatters and all(
        n.input[0] in {c.output[0] for c in model.graph.node if c.op_type == "Cast"}
        for n in scatters
        if any(a.name == "reduction" and a.s == b"add" for a in n.attribute)
    )
    half_session, full_session = ort_session(result.path), ort_session(exported.path)
    # #34: the fp16 file takes every size too — the traced one and a non-square one (24 x 16 latent)
    for hw in ((16, 16), (24, 16)):
        feed = standard_feed(2)
        feed["sample"] = torch.randn(2, 4, *hw, generator=torch.Generator().manual_seed(1)).numpy()
        half = half_session.run(
            None, {k: v.astype(np.float16) if v.dtype == np.float32 and k != "timestep" else v
                   for k, v in feed.items()})[0]
        full = full_session.run(None, feed)[0]
        assert half.dtype == np.float16 and half.shape == (2, 4, *hw)
        # fp16 vs the fp32 export: same destinations, fp16 rounding only
        assert np.abs(half.astype(np.float32) - full).max() < 2e-2 * max(1.0, float(np.abs(full).max()))


def test_fp16_parity_session_keeps_the_weights_fp16(exported):
    """Issue #20: the CPU EP's default level stores an fp32 copy of every fp16 conv / matmul weight
    (the README's SDXL parity peaked at 4.1x the weights); an fp16 check loads at basic level with
    priority-based order (each weight cast when its op runs). fp32 files keep the default."""
    import onnxruntime as ort
    from tome_compile.export import parity

    half = parity.session(exported.path, fp16=True).get_session_options()
    full = parity.session(exported.path, fp16=False).get_session_options()
    assert half.graph_optimization_level == ort.GraphOptimizationLevel.ORT_ENABLE_BASIC
    assert half.execution_order == ort.ExecutionOrder.PRIORITY_BASED
    assert full.graph_optimization_level == ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    assert full.execution_order == ort.ExecutionOrder.DEFAULT


def test_optimizer_finds_the_plain_exports_fusions(tmp_path, unet, exported):
    from tome_compile.export.onnx_export import optimize_for_ort

    plain = export_onnx(
        copy.deepcopy(unet),
        tmp_path / "plain.onnx",
        ToMeConfig(ratio=0.0),
        height=HW,
        width=HW,
        seq_len=7,
        check_parity=False,
        static=True,  # the fusions do not depend on the size axes; a fixed file converts in half the time
    )
    assert plain.report.rewritten == [] and plain.fused_attention == 8
    for provider in ("cpu", "cuda"):
        ours = optimize_for_ort(exported.path, tmp_path / f"ours_{provider}.onnx", provider)
        theirs = optimize_for_ort(plain.path, tmp_path / f"plain_{provider}.onnx", provider)
        for op in ("MultiHeadAttention", "LayerNormalization", "SkipLayerNormalization", "GroupNorm",
                   "SkipGroupNorm"):
            assert ours.get(op, 0) == theirs.get(op, 0), (provider, op, ours, theirs)
        assert theirs["SkipLayerNormalization"] == 8
    assert theirs["GroupNorm"] + theirs["SkipGroupNorm"] == 21  # CUDA: every group norm fused
    # the optimised any-size file keeps Optimum's symbolic axes and runs another size, non-square
    optimized = onnx.load(str(tmp_path / "ours_cpu.onnx"), load_external_data=False)
    dims = {i.name: [d.dim_param or d.dim_value for d in i.type.tensor_type.shape.dim]
            for i in [*optimized.graph.input, *optimized.graph.output]}
    assert dims["sample"] == dims["out_sample"] == ["batch_size", 4, "height", "width"]
    assert dims["encoder_hidden_states"] == ["batch_size", "sequence_length", 32]
    g = torch.Generator().manual_seed(3)
    feed = {"sample": torch.randn(1, 4, 12, 20, generator=g).numpy(),
            "timestep": np.array([500.0], np.float32),
            "encoder_hidden_states": torch.randn(1, 5, 32, generator=g).numpy()}
    got = ort_session(tmp_path / "ours_cpu.onnx").run(None, feed)[0]
    want = ort_session(exported.path).run(None, feed)[0]
    assert got.shape == (1, 4, 12, 20) and np.abs(got - want).max() <= 1e-4


def test_gpu_check_runs_one_file_at_two_sizes(exported, sd15_folder):
    """gpu_check's any-size part, on two CPU sessions (the GPU machine runs it CUDA vs CPU): one
    file at the traced size and a non-square one, the same numbers from both sessions."""
    from tome_compile.benchmarks.gpu_check import two_sizes

    rows = two_sizes(exported.path, str(sd15_folder), [(HW, HW), (96, 160)], batch=2, repeats=1,
                     providers=("CPUExecutionProvider", "CPUExecutionProvider"))
    assert [size for size, _, _ in rows] == [(HW, HW), (96, 160)]
    assert all(t > 0 and diff == 0.0 for _, t, diff in rows)


def test_optimizer_leaves_the_weights_on_disk_and_writes_only_live_ones(tmp_path, exported):
    """Issue #20 (export memory): ORT's optimizer runs on the graph with its matrices and kernels
    on disk (only vectors are read in; for CUDA also the Conv kernels NhwcConv transposes), and the
    optimised file's data holds exactly the tensors its graph uses, copied byte for byte."""
    from onnx.external_data_helper import ExternalDataInfo, uses_external_data
    from tome_compile.export.ort_optimizer import load_for_fusions, optimize_for_ort

    def on_disk(proto):
        return {t.name for t in proto.graph.initializer if uses_external_data(t)}

    src = onnx.load(str(exported.path), load_external_data=False)
    cpu, cuda = load_for_fusions(exported.path, "cpu"), load_for_fusions(exported.path, "cuda")
    matrices = {t.name for t in src.graph.initializer if sum(d > 1 for d in t.dims) >= 2}
    kernels = {n.input[1] for n in src.graph.node if n.op_type == "Conv"}
    assert len(matrices) > 50 and kernels <= matrices
    assert on_disk(cpu) == matrices  # vectors read in, every matrix and kernel left on disk
    assert on_disk(cuda) == matrices - kernels  # NhwcConv reads the kernels
    assert all(t.raw_data or t.float_data for t in cpu.graph.initializer if t.name not in matrices)

    dst = tmp_path / "opt" / "unet.onnx"
    fusions = optimize_for_ort(exported.path, dst, "cpu")
    assert fusions["SkipLayerNormalization"] == 8 and fusions["MultiHeadAttention"] == 8
    assert sorted(p.name for p in dst.parent.iterdir()) == ["unet.onnx", "unet.onnx.data"]
    out = onnx.load(str(dst), load_external_data=False)
    used = {name for n in out.graph.node for name in n.input}
    stored = [t for t in out.graph.initializer if uses_external_data(t)]
    assert {t.name for t in stored} <= used and {ExternalDataInfo(t).location for t in stored} == {
        "unet.onnx.data"
    }
    assert (dst.parent / "unet.onnx.data").stat().st_size == sum(ExternalDataInfo(t).length for t in stored)
    full_src = {
        t.name: onnx.numpy_helper.to_array(t) for t in onnx.load(str(exported.path)).graph.initializer
    }
    full_out = onnx.load(str(dst))
    for t in full_out.graph.initializer:
        if t.name in matrices:  # streamed from the source's data file
            np.testing.assert_array_equal(onnx.numpy_helper.to_array(t), full_src[t.name])
    feed = standard_feed(2)
    np.testing.assert_allclose(
        ort_session(dst).run(None, feed)[0], ort_session(exported.path).run(None, feed)[0], atol=1e-5
    )


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA and onnxruntime-gpu")
def test_cuda_session_parity(exported, unet):
    import onnxruntime as ort

    if "CUDAExecutionProvider" not in ort.get_available_providers():
        pytest.skip("onnxruntime-gpu not installed")
    cpu = ToMeSession(exported.path, seed=1, providers=["CPUExecutionProvider"])
    gpu = ToMeSession(exported.path, seed=1)
    assert gpu.provider == "CUDAExecutionProvider"
    inputs = tiny_inputs(unet)
    a = cpu(inputs.sample, inputs.timestep, inputs.encoder_hidden_states).sample
    b = gpu(inputs.sample, inputs.timestep, inputs.encoder_hidden_states).sample
    assert (a - b).abs().max() < 1e-3


def test_session_io_binding_equals_numpy_path(exported, unet):
    # The CUDA EP path (tensors bound by pointer, output written into a torch tensor), run on CPU.
    inputs = tiny_inputs(unet)
    plain = ToMeSession(exported.path, seed=0, io_binding=False)
    bound = ToMeSession(exported.path, seed=0, io_binding=True)
    a = plain(inputs.sample, inputs.timestep, inputs.encoder_hidden_states).sample
    b = bound(inputs.sample, inputs.timestep, inputs.encoder_hidden_states).sample
    assert bound.io_binding and torch.equal(a, b)
    with pytest.raises(ToMeExportError, match="multiples of 2"):
        bound(torch.zeros(2, 4, 8, 7), 1, torch.zeros(2, 7, 32))


def test_merge_scatters_take_int32_indices(exported):
    """ORT materialises the merge's expanded [B, N, C] index: every ScatterElements reads it as
    int32 (a Cast before the Expand), counted in the metadata; parity is the fixture's check."""
    model = onnx.load(str(exported.path), load_external_data=False)
    nodes = list(model.graph.node)
    for node in model.graph.node:  # If branches (none in the default export, but keep it honest)
        nodes += [n for attr in node.attribute if attr.g is not None for n in attr.g.node]
    made = {out: n for n in nodes for out in n.output}
    scatters = [n for n in nodes if n.op_type == "ScatterElements" and made[n.input[1]].op_type == "Expand"]
    assert scatters and ToMeSession(exported.path).meta.int32_scatter_indices == len(scatters)
    for scatter in scatters:
        expand = made[scatter.input[1]]
        cast = made[expand.input[0]]
        assert expand.op_type == "Expand" and cast.op_type == "Cast"
        assert next(a.i for a in cast.attribute if a.name == "to") == onnx.TensorProto.INT32
    # the int64 Expands they replaced are gone, not left dead in the graph
    read = {name for n in nodes for name in n.input} | {o.name for o in model.graph.output}
    assert all(n.output[0] in read for n in nodes if n.op_type == "Expand")


def test_each_merge_starts_from_its_own_zeros(exported, tmp_path):
    """Issue #20: a shape-only ``torch.zeros`` in the merge was one ``Expand`` for every merge of a
    size, alive from the first merge to the last (SD 1.5 512², batch 2: 5.2 MB at the peak of an
    ORT call; measured 0.820 -> 0.815 GB per call). The zeros now come from each merge's own plan."""
    model = onnx.load(str(exported.path), load_external_data=False)
    scatters = [n for n in model.graph.node if n.op_type == "ScatterElements"]
    assert len(scatters) >= 3 and shared_merge_zeros(model) == []
    # negative: two scatters planted on one Expand are found
    h = onnx.helper
    planted = h.make_graph(
        [h.make_node("Expand", ["z", "shape"], ["zeros"]), h.make_node("Expand", ["i", "shape"], ["index"]),
         h.make_node("ScatterElements", ["zeros", "index", "x"], ["a"], axis=1, reduction="add"),
         h.make_node("ScatterElements", ["zeros", "index", "y"], ["b"], axis=1, reduction="add")],
        "planted", [], [])
    assert shared_merge_zeros(h.make_model(planted)) == ["zeros"]


def test_the_merges_make_nothing_before_their_block(exported):
    """Issue #20: ToMe's file held more than the plain one at the peak of an ORT call. Its merges
    scattered into shape-only ``zeros`` / ``empty`` / ``full`` / ``ones`` (one value for every block
    of a size, computed once and held from the first block to the last), and the hashed partition
    was computed for every block at once, from the seed, at the start of the call. Now every value
    a scatter reads comes from its block's input, and each block hashes its own cells when it
    runs: SD 1.5 512², batch 2, the live values at the peak 224.34 MB -> 224.31 MB = the plain
    file's +80 bytes (ORT's profile, execution order)."""
    model = onnx.load(str(exported.path), load_external_data=False)
    assert sum(n.op_type == "ScatterElements" for n in model.graph.node) >= 6
    assert made_before_the_blocks(model) == {"scatter": [], "seeded": []}
    # negative: a scatter from shape-only zeros and a whole partition hashed from the seed are found
    h = onnx.helper
    planted = h.make_graph(
        [h.make_node("Shape", ["sample"], ["shape"]), h.make_node("ConstantOfShape", ["shape"], ["zeros"]),
         h.make_node("ScatterElements", ["zeros", "index", "sample"], ["merged"], axis=1, reduction="add"),
         h.make_node("Expand", [SEED_INPUT, "shape"], ["hashed"])],
        "planted",
        [h.make_tensor_value_info("sample", onnx.TensorProto.FLOAT, [2, 8]),
         h.make_tensor_value_info(SEED_INPUT, onnx.TensorProto.INT64, []),
         h.make_tensor_value_info("index", onnx.TensorProto.INT64, [2, 8])],
        [h.make_tensor_value_info("merged", onnx.TensorProto.FLOAT, [2, 8]),
         h.make_tensor_value_info("hashed", onnx.TensorProto.INT64, [2, 8])])
    assert made_before_the_blocks(h.make_model(planted)) == {"scatter": ["zeros"], "seeded": ["hashed"]}


def test_metadata_round_trip_and_files_without_it(tmp_path, exported):
    """The metadata is one dataclass written and read by the same code (#19); a file without it is
    not a tome-export file (apply() and tome-serve refuse it: they test ``exported``, since the
    defaults of an empty ExportMetadata are a valid object); another version is refused."""
    from tome_compile.export.metadata import METADATA_KEY, ExportMetadata

    from tome_compile import apply

    model = onnx.load(str(exported.path), load_external_data=False)
    meta = ExportMetadata.of_model(model)
    assert meta is not None and ExportMetadata.from_json(meta.to_json()) == meta
    assert [s.name for s in meta.tome_inputs] == exported.report.input_names and meta.height == HW
    assert meta.optional_inputs == exported.optional_inputs
    assert meta.fused_attention == exported.fused_attention

    plain = _optimum_folder(tmp_path) / "unet" / "model.onnx"
    session = ToMeSession(plain)
    assert not session.exported and session.specs == [] and ToMeSession(exported.path).exported

    class Pipe:  # an ONNX pipeline: its unet is not a torch module
        unet = object()

    with pytest.raises(ToMeError, match="is not a tome-export file"):
        apply(Pipe(), onnx=plain)

    old = onnx.load(str(plain))
    old.metadata_props.add(key=METADATA_KEY, value='{"version": 1}')
    onnx.save(old, str(tmp_path / "old.onnx"))
    with pytest.raises(ToMeExportError, match="another tome-compile version .* version 1"):
        ToMeSession(tmp_path / "old.onnx")


def test_34_diffusers_onnx_pipeline_generates_two_sizes_from_one_file(exported):
    """#34: the file replaces Optimum's plain export, which serves every size: diffusers' ONNX
    pipeline (3 standard inputs, NumPy) generates at 128² and at 96 x 160 from the same file (it
    failed with ORT's "Got invalid dimensions for input: sample" before), and a raw client at a
    third size and batch 3 gets what ToMeSession gets."""
    from test_call_state import onnx_pipeline

    pipe = onnx_pipeline(exported.path)
    for height, width in ((128, 128), (96, 160)):
        g = np.random.RandomState(0)
        latents = g.randn(1, 4, height // 8, width // 8).astype(np.float32)
        out = pipe(prompt_embeds=np.ones((1, 7, 32), np.float32), negative_prompt_embeds=np.zeros((1, 7, 32),
                   np.float32), height=height, width=width, num_inference_steps=2, output_type="np",
                   latents=latents).images
        assert out.shape[1:3] == (height // 8, width // 8) and np.isfinite(out).all()
    # the raw file at a third size and batch 3 equals a ToMeSession call there (one code path)
    session = ToMeSession(exported.path)
    feed = {"sample": np.random.RandomState(1).randn(3, 4, 20, 12).astype(np.float32),
            "timestep": np.array([500.0], np.float32),
            "encoder_hidden_states": np.random.RandomState(2).randn(3, 5, 32).astype(np.float32)}
    raw = ort_session(exported.path).run(None, feed)[0]
    got = session(torch.from_numpy(feed["sample"]), 500.0, torch.from_numpy(feed["encoder_hidden_states"]))
    assert raw.shape == (3, 4, 20, 12) and np.array_equal(raw, got.sample.numpy())
