"""What the tome-export tests share: the tiny models' image size, ONNX Runtime sessions and feeds,
the graph checks."""

from __future__ import annotations

import numpy as np
import onnx
import torch
from tome_compile.passes import SEED_INPUT

HW = 128  # image size of the tiny latent-space models: 16 x 16 latent, 256 tokens at full resolution


def ort_session(path):
    import onnxruntime as ort

    return ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])


def standard_feed(batch, t=999.0, seed=0):
    g = torch.Generator().manual_seed(seed)
    return {"sample": torch.randn(batch, 4, 16, 16, generator=g).numpy(),
            "timestep": np.array([t], dtype=np.float32),
            "encoder_hidden_states": torch.randn(batch, 7, 32, generator=g).numpy()}


def attention_modules(unet):
    from diffusers.models.attention_processor import Attention

    return sum(isinstance(m, Attention) for m in unet.modules())


def one_error_line(err):
    """One line of error (the progress bar shares stderr), no traceback."""
    return err.count("tome-export: error:") == 1 and "Traceback" not in err and err.count("Error") == 0


def _base(folder):
    return ["--model", str(folder), "--height", str(HW), "--width", str(HW), "--seq-len", "7"]


# The tests of the output files' life (temp folder, atomic rename, signals, disk full) export a fixed
# size: what they check does not depend on the size axes, and the fixed export converts in about half
# the time (the any-size file is tested in test_export.py and test_export_forms.py)
FIXED = ["--static"]


def _optimum_folder(tmp_path, pipeline="ORTStableDiffusionPipeline"):
    """A folder laid out like `optimum-cli export onnx` writes: model_index.json, unet/model.onnx
    with its weights in unet/model.onnx_data, unet/config.json."""
    folder = tmp_path / "sd-onnx"
    (folder / "unet").mkdir(parents=True)
    (folder / "model_index.json").write_text(f'{{"_class_name": "{pipeline}"}}')
    (folder / "unet" / "config.json").write_text('{"in_channels": 4, "cross_attention_dim": 32}')
    x = onnx.helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [4])
    y = onnx.helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [4])
    w = onnx.numpy_helper.from_array(np.ones(4096, np.float32)[:4].copy(), "w")
    model = onnx.helper.make_model(
        onnx.helper.make_graph([onnx.helper.make_node("Add", ["x", "w"], ["y"])], "old", [x], [y], [w])
    )
    onnx.save(model, str(folder / "unet" / "model.onnx"), save_as_external_data=True,
              location="model.onnx_data", size_threshold=0)
    return folder


def shared_merge_zeros(model) -> list[str]:
    """The zeros (``Expand``, through any ``Cast``) that more than one merge's ScatterElements
    starts from: a value the model computes once and holds from the first merge to the last."""
    nodes = list(model.graph.node)
    made = {out: n for n in nodes for out in n.output}
    seen: dict[str, int] = {}
    for n in nodes:
        if n.op_type == "ScatterElements" and n.input[1] in made and made[n.input[1]].op_type == "Expand":
            source = made.get(n.input[0])
            while source is not None and source.op_type == "Cast":
                source = made.get(source.input[0])
            if source is not None and source.op_type == "Expand":
                seen[source.output[0]] = seen.get(source.output[0], 0) + 1
    return [name for name, count in seen.items() if count > 1]


def made_before_the_blocks(model, late=("sample", "encoder_hidden_states")) -> dict[str, list[str]]:
    """What the merges read that the model can compute from its other inputs alone (constants, the
    batch size, ``tome_seed``, the timestep): ONNX Runtime's default order runs such a node at the
    start of a call, and every block that reads it holds it from there. Returns the values
    ``ScatterElements`` read as data or updates, and the values of more than one element made
    from ``tome_seed``."""
    from onnx import shape_inference

    model = shape_inference.infer_shapes(model)
    shapes = {v.name: [d.dim_value if d.HasField("dim_value") else None for d in v.type.tensor_type.shape.dim]
              for v in list(model.graph.value_info) + list(model.graph.output)}
    # late: waits for a block (reads the latents or the text); early: made from the other inputs
    # (a Shape of the latents is early: ORT knows it at the start); constants alone fold away
    late_values, seeded = set(late), {SEED_INPUT}
    early = {i.name for i in model.graph.input} - late_values
    for n in model.graph.node:  # topological in a valid ONNX file
        if n.op_type in ("Shape", "Size") and n.input[0] in late:
            early.update(n.output)
        elif any(i in late_values for i in n.input):
            late_values.update(n.output)
        elif any(i in early for i in n.input):
            early.update(n.output)
            if any(i in seeded for i in n.input):
                seeded.update(n.output)
    scattered = [i for n in model.graph.node if n.op_type == "ScatterElements"
                 for i in (n.input[0], n.input[2]) if i in early]
    big = [v for v in seeded - {SEED_INPUT}
           if v not in shapes or None in shapes[v] or int(np.prod(shapes[v])) > 1]
    return {"scatter": sorted(set(scattered)), "seeded": sorted(big)}
