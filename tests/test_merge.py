"""The merge math against tomesd's bipartite_soft_matching_random2d (the reference oracle)."""

from __future__ import annotations

import pytest
import torch
from tomesd.merge import bipartite_soft_matching_random2d

from tome_compile.merge import (
    destination_partition,
    gather_rows,
    merge_tokens,
    merge_tokens_by_heads,
    oracle_merge,
    oracle_unmerge,
    tome_plan,
    unmerge_tokens,
)


@pytest.mark.parametrize("h, w, sx, sy, ratio, batch", [
    (16, 16, 2, 2, 0.5, 2),
    (15, 17, 2, 2, 0.4, 3),   # non-divisible grid: leftover rows/columns are sources
    (8, 8, 2, 2, 0.75, 1),    # r capped at the number of sources
    (9, 7, 3, 2, 0.3, 2),
])
@pytest.mark.parametrize("use_rand", [False, True])
def test_plan_equals_tomesd(h, w, sx, sy, ratio, batch, use_rand):
    torch.manual_seed(0)
    metric = torch.randn(batch, h * w, 24)
    x = torch.randn(batch, h * w, 16)
    r = int(h * w * ratio)
    choice = None
    if use_rand:
        choice = torch.randint(sx * sy, (h // sy, w // sx, 1), generator=torch.Generator().manual_seed(7))
    m, u = bipartite_soft_matching_random2d(metric, w, h, sx, sy, r, no_rand=not use_rand,
                                            generator=torch.Generator().manual_seed(7))
    slot, weight = tome_plan(metric, None if choice is None else choice.reshape(-1), h, w, sx, sy, r)
    merged = merge_tokens(x, slot, weight)
    expected = m(x)
    assert merged.shape == expected.shape
    # The same tokens are kept and merged (tomesd's argsort scrambles the order of destinations,
    # so compare as multisets of rows), and unmerge(merge(x)) is the same tensor.
    assert torch.allclose(merged.sort(dim=1).values, expected.sort(dim=1).values, atol=1e-6)
    assert torch.allclose(unmerge_tokens(merged, slot), u(expected), atol=1e-6)
    assert torch.equal(merge_tokens_by_heads(x, slot, weight), merged)  # the ONNX form, the same bits


def test_merge_is_a_mean_counting_the_destination_once():
    # 1 x 4 grid, stride 2 x 1: destinations are tokens 0 and 2; sources 1 and 3.
    metric = torch.tensor([[[1.0, 0.0], [1.0, 0.1], [0.0, 1.0], [0.1, 1.0]]])
    x = torch.tensor([[[1.0], [3.0], [10.0], [20.0]]])
    slot, weight = tome_plan(metric, None, 1, 4, 2, 1, r=2)
    merged = merge_tokens(x, slot, weight)
    assert merged.shape == (1, 2, 1)
    assert sorted(merged.flatten().tolist()) == [2.0, 15.0]
    assert unmerge_tokens(merged, slot).flatten().tolist() == [2.0, 2.0, 15.0, 15.0]


def test_ties_are_broken_by_index():
    # Every token identical: every score ties. The lowest source indices are merged first, in
    # every backend (stable sort; ONNX TopK breaks ties the same way).
    metric = torch.ones(1, 16, 4)
    slot, _ = tome_plan(metric, None, 4, 4, 2, 2, r=4)
    dst, src = destination_partition(None, 4, 4, 2, 2, torch.device("cpu"))
    assert dst.tolist() == [0, 2, 8, 10]
    merged_sources = [t for t in src.tolist() if slot[0, t] >= 12 - 4]
    assert merged_sources == src.tolist()[:4]


def test_partition_from_choice():
    choice = torch.tensor([0, 1, 2, 3])  # one per 2 x 2 cell of a 4 x 4 grid
    dst, src = destination_partition(choice, 4, 4, 2, 2, torch.device("cpu"))
    assert dst.tolist() == [0, 3, 12, 15]  # (row, col) = (0,0), (0,3), (3,0), (3,3)
    assert sorted(dst.tolist() + src.tolist()) == list(range(16))


def test_plan_has_fixed_shapes_for_any_data():
    for seed in range(3):
        metric = torch.randn(2, 64, 8, generator=torch.Generator().manual_seed(seed))
        slot, weight = tome_plan(metric, None, 8, 8, 2, 2, r=20)
        assert slot.shape == (2, 64) and weight.shape == (2, 44, 1)
        assert int(slot.max()) == 43 and int(slot.min()) == 0


def test_oracle_shapes():
    x = torch.randn(2, 10, 3)
    y = oracle_merge(x, 4)
    assert y.shape == (2, 6, 3)
    assert oracle_unmerge(y, 4).shape == x.shape


def test_matching_in_blocks_never_holds_the_whole_score_matrix():
    """Issue #20: the similarity is computed in blocks of sources no larger than the sources'
    features, with the same best destination per source as the whole matrix."""
    from tome_compile.merge import best_matches, match_rows, row_max

    assert match_rows(12288, 4096, 320) == 960  # SD 1.5 at 1024²: 13 blocks of <= 960 x 4096 scores
    assert match_rows(3072, 1024, 640) == 1920  # SDXL at 1024², max_downsample=2
    assert match_rows(100, 10, 64) == 100  # scores no larger than the features: one block
    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(2, 300, 8, generator=g), torch.randn(2, 100, 8, generator=g)
    score, index = best_matches(a, b)  # 300 * 8 // 100 = 24 sources per block: 13 blocks
    full_score, full_index = row_max(a @ b.transpose(-1, -2))
    assert torch.equal(index, full_index) and torch.allclose(score, full_score, atol=1e-6)
    from torch.fx.experimental.proxy_tensor import make_fx

    def products(*args):
        return sum("bmm" in str(n.target) for n in make_fx(best_matches)(*args).graph.nodes)

    assert products(a, b) == 13  # the traced graph holds 13 products of [<= 24, 100] scores
    assert products(a[:, :10], b[:, :5]) == 1  # negative: scores no larger than the features: one product


def test_gather_rows_equals_gather_and_exports_without_an_expanded_index(tmp_path):
    """The unmerge and the metric gathers read rows by number: the same numbers as gather with an
    expanded index, and in ONNX one Gather of B x N row numbers (no [B, N, C] int64 index, which
    ONNX Runtime would materialise: twice an fp32 activation)."""
    import onnx

    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 7, 5, generator=g)
    index = torch.randint(0, 7, (3, 11), generator=g)
    expected = x.gather(1, index.unsqueeze(-1).expand(3, 11, 5))
    assert torch.equal(gather_rows(x, index), expected)
    assert torch.equal(gather_rows(x, index[:1]), x.gather(1, index[:1].unsqueeze(-1).expand(3, 11, 5)))

    class Rows(torch.nn.Module):
        def forward(self, x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
            return gather_rows(x, index)

    class Elements(torch.nn.Module):  # negative: the expanded-index form
        def forward(self, x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
            return x.gather(1, index.unsqueeze(-1).expand(-1, -1, x.shape[-1]))

    ops = {}
    for name, module in (("rows", Rows()), ("elements", Elements())):
        path = tmp_path / f"{name}.onnx"
        torch.onnx.export(module.eval(), (x, index), str(path), dynamo=True, verbose=False)
        ops[name] = {n.op_type for n in onnx.load(str(path)).graph.node}
    assert "Gather" in ops["rows"] and "GatherElements" not in ops["rows"]
    assert "GatherElements" in ops["elements"]


def test_merge_by_heads_scatters_only_the_merged_tokens(tmp_path):
    """The export's merge (issue #20): one gathered head per slot plus a scatter-add of the other r
    tokens — the same bits as merge_tokens for any plan (every token in one slot, each token its
    own slot, random: the sums run in the same order), and in ONNX a ScatterElements(add) of r
    rows, not N, with ONNX Runtime's result equal to PyTorch's bit for bit (issue #20: the first
    form summed in TopK's tie order, which differs between the two, and an SD 1.5 export at
    1024² failed its parity check on a plan that flipped)."""
    import onnx
    import onnxruntime as ort

    g = torch.Generator().manual_seed(3)
    b, n, m, c = 2, 40, 9, 16
    x = torch.randn(b, n, c, generator=g)
    own = torch.arange(m).expand(b, m)  # every slot has a token
    plans = {
        "random": torch.cat([own, torch.randint(0, m, (b, n - m), generator=g)], 1),
        "one slot": torch.cat([own, torch.full((b, n - m), 2)], 1),
        "reversed": torch.cat([torch.randint(0, m, (b, n - m), generator=g), own.flip(1)], 1),
    }
    for name, slot in plans.items():
        weight = torch.zeros(b, m).scatter_add(1, slot, torch.ones(b, n)).reciprocal().unsqueeze(-1)
        assert torch.equal(merge_tokens_by_heads(x, slot, weight), merge_tokens(x, slot, weight)), name
    same = torch.arange(n).expand(b, n)  # r = 0: nothing to add
    assert torch.equal(merge_tokens_by_heads(x, same, torch.ones(b, n, 1)), x)

    class Heads(torch.nn.Module):
        def forward(self, x, slot, weight):
            return merge_tokens_by_heads(x, slot, weight)

    class Scatter(torch.nn.Module):  # negative: every token scattered
        def forward(self, x, slot, weight):
            return merge_tokens(x, slot, weight)

    slot = plans["random"]
    weight = torch.zeros(b, m).scatter_add(1, slot, torch.ones(b, n)).reciprocal().unsqueeze(-1)
    rows, got = {}, {}
    for name, module in (("heads", Heads()), ("scatter", Scatter())):
        path = tmp_path / f"{name}.onnx"
        torch.onnx.export(module.eval(), (x, slot, weight), str(path), dynamo=True, verbose=False)
        model = onnx.shape_inference.infer_shapes(onnx.load(str(path)))
        shapes = {v.name: [d.dim_value for d in v.type.tensor_type.shape.dim]
                  for v in [*model.graph.value_info, *model.graph.input]}
        adds = [node for node in model.graph.node if node.op_type == "ScatterElements"
                and any(a.name == "reduction" and a.s == b"add" for a in node.attribute)]
        rows[name] = [shapes[node.input[2]][1] for node in adds]
        session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
        got[name] = session.run(None, {"x": x.numpy(), "slot": slot.numpy(), "weight": weight.numpy()})[0]
    assert rows == {"heads": [n - m], "scatter": [n]}
    expected = merge_tokens(x, slot, weight).numpy()
    assert (got["heads"] == expected).all() and (got["scatter"] == expected).all()


def test_importing_the_math_loads_no_pass_or_backend():
    """``tome_compile.merge`` is pure tensor math: importing it (and so the package) loads neither
    the pass, the backend nor Dynamo; asking the package for the backend does."""
    import ast
    import subprocess
    import sys

    probe = ("import sys, {stmt}; print(sorted(m for m in sys.modules if m.startswith("
             "('tome_compile.backend', 'tome_compile.passes', 'tome_compile.state', 'torch._dynamo'))))")

    def loaded(stmt):
        out = subprocess.run([sys.executable, "-c", probe.format(stmt=stmt)], capture_output=True, text=True,
                             timeout=300, check=True).stdout
        return ast.literal_eval(out)  # a printed list of module names

    assert loaded("tome_compile.merge") == []
    assert loaded("tome_compile.config") == []
    after = loaded("tome_compile; tome_compile.tome_backend")
    assert "tome_compile.backend" in after and "tome_compile.passes" in after
