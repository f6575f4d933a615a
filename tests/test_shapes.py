"""The procedural data of the project's own model, and saving/loading its weights offline."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tome_compile.shapes.data import COLOURS, SHAPES, VOCAB, render, render_batch, tokenize
from tome_compile.shapes.model import build_model, load_model, save_model


def test_render_is_deterministic():
    a, b, c = render(7), render(7), render(8)
    assert np.array_equal(a.image, b.image) and a.prompt == b.prompt
    assert not np.array_equal(a.image, c.image)
    assert a.image.shape == (32, 32, 3) and a.image.dtype == np.float32
    assert 0.0 <= a.image.min() and a.image.max() <= 1.0


def test_every_class_is_drawn_and_coloured():
    images, prompts = render_batch(range(300))
    assert images.shape == (300, 3, 32, 32) and -1.0 <= images.min() and images.max() <= 1.0
    words = [p.split() for p in prompts]
    assert {w[0] for w in words} == set(COLOURS) and {w[1] for w in words} == set(SHAPES)
    for colour, rgb in COLOURS.items():  # the prompted colour is really in the picture
        example = render(3, colour=colour, shape="square")
        distance = np.abs(example.image - np.asarray(rgb)).sum(-1)
        assert (distance < 0.05).mean() > 0.05


def test_shapes_differ_in_area():
    # The same seed (position, size, background) with different shapes gives different masks.
    masks = {s: (np.abs(render(11, colour="red", shape=s).image - COLOURS["red"]).sum(-1) < 0.05).sum()
             for s in SHAPES}
    assert len(set(masks.values())) == len(SHAPES)
    assert masks["ring"] < masks["circle"]


def test_tokenize():
    assert tokenize("red circle") == [VOCAB.index("red"), VOCAB.index("circle")]
    assert tokenize("") == [0, 0]  # the null prompt
    with pytest.raises(ValueError, match="must be '<colour> <shape>'"):
        tokenize("purple hexagon")


def test_model_has_1024_token_attention_and_round_trips(tmp_path):
    model = build_model(seed=1)
    ehs = model.text.encode(["red circle", ""])
    assert ehs.shape == (2, 2, 64)
    out = model.unet(torch.randn(2, 3, 32, 32), torch.tensor(10), encoder_hidden_states=ehs).sample
    assert out.shape == (2, 3, 32, 32)
    attn = model.unet.down_blocks[0].attentions[0].transformer_blocks[0].attn1
    assert attn is not None and model.unet.config.block_out_channels[0] == 32  # 32x32 = 1024 tokens
    save_model(model, tmp_path)
    loaded = load_model(tmp_path)
    for (k, a), (_, b) in zip(model.state_dict().items(), loaded.state_dict().items(), strict=True):
        assert torch.equal(a, b), k


def test_generate_two_steps_plain_and_compiled():
    from tome_compile import tome_backend
    from tome_compile.shapes.sample import generate

    model = build_model(seed=2).eval()
    plain = generate(model, ["red circle", "blue ring"], [0, 1], steps=2)
    assert plain.shape == (2, 3, 32, 32) and 0.0 <= plain.min() and plain.max() <= 1.0
    compiled = torch.compile(model.unet, backend=tome_backend(0.5, compiler="eager", seed=0), fullgraph=True)
    merged = generate(model, ["red circle", "blue ring"], [0, 1], steps=2, unet=compiled)
    assert merged.shape == plain.shape and not torch.equal(merged, plain)
    with pytest.raises(ValueError, match="one seed per prompt"):
        generate(model, ["red circle"], [0, 1])


def test_shipped_probe_loads_offline_and_reads_pictures():
    from tome_compile.shapes.probe import load_probe

    probe = load_probe()  # from the package, no network
    images, prompts = render_batch(range(30_000_000, 30_000_300))  # pictures it never saw
    predicted = probe.predict((torch.from_numpy(images) + 1) / 2)
    accuracy = sum(p == q for p, q in zip(predicted, prompts, strict=True)) / len(prompts)
    assert accuracy >= 0.95


def test_shipped_model_loads_offline_and_draws_the_prompt(monkeypatch):
    import socket

    from tome_compile.shapes.probe import load_probe
    from tome_compile.shapes.sample import generate

    def no_network(*args, **kwargs):
        raise AssertionError("the shipped model must load without the network")

    monkeypatch.setattr(socket.socket, "connect", no_network)
    model, probe = load_model(), load_probe()  # both from the package
    assert sum(p.numel() for p in model.parameters()) > 2_000_000
    prompts = [
        f"{c} {s}" for c, s in zip(COLOURS, [*SHAPES, SHAPES[0]], strict=True)
    ]  # every colour and shape
    images = generate(model, prompts, list(range(len(prompts))), steps=10)
    predicted = probe.predict(images)
    colours = sum(p.split()[0] == q.split()[0] for p, q in zip(predicted, prompts, strict=True))
    both = sum(p == q for p, q in zip(predicted, prompts, strict=True))
    assert colours >= 5 and both >= 4, (predicted, prompts)
    # an untrained model of the same architecture draws nothing the probe recognises this often
    untrained = probe.predict(
        generate(build_model(seed=0).eval(), prompts, list(range(len(prompts))), steps=10)
    )
    assert sum(p == q for p, q in zip(untrained, prompts, strict=True)) < both


def test_psnr_and_ssim():
    from tome_compile.shapes.metrics import psnr, ssim

    a = torch.rand(3, 3, 32, 32, generator=torch.Generator().manual_seed(0))
    assert torch.allclose(ssim(a, a), torch.ones(3), atol=1e-5)
    assert torch.isinf(psnr(a, a)).all()
    noisy = (a + 0.1 * torch.randn(a.shape, generator=torch.Generator().manual_seed(1))).clamp(0, 1)
    worse = (a + 0.3 * torch.randn(a.shape, generator=torch.Generator().manual_seed(1))).clamp(0, 1)
    assert (ssim(a, noisy) > ssim(a, worse)).all() and (ssim(a, worse) < 0.9).all()
    assert torch.allclose(psnr(torch.zeros(1, 1, 4, 4), torch.full((1, 1, 4, 4), 0.1)), torch.tensor([20.0]))


def test_demo_command(tmp_path, capsys):
    import json

    from tome_compile.shapes.demo import main

    save_model(build_model(seed=3), tmp_path / "m")
    out = tmp_path / "demo.png"
    code = main(["--model", str(tmp_path / "m"), "--steps", "2", "--seeds", "1", "--prompts", "red circle",
                 "blue ring", "--compiler", "eager", "--out", str(out)])
    printed = capsys.readouterr().out
    assert code == 0 and out.is_file()
    data = json.loads(out.with_suffix(".json").read_text())
    assert data["rows"] == ["plain", "tome 0.5", "importance 0.5", "todo x2"]
    assert [r["method"] for r in data["results"]] == data["rows"]
    todo, tome = data["results"][3], data["results"][1]
    assert todo["psnr_db"] > 0 and todo["psnr_db"] != tome["psnr_db"]
    assert data["results"][1]["psnr_db"] > 0 and 0 < data["results"][1]["ssim"] <= 1
    assert "| tome 0.5 |" in printed and "PSNR" in printed


@pytest.mark.parametrize("argv, words", [
    (["--prompts", "purple hexagon"], "must be '<colour> <shape>'"),
    (["--ratio", "0.9"], "ratio=0.9"),
    (["--model", "/nonexistent"], "does not exist"),
    (["--model", "."], "no model.safetensors"),
    (["--out", "grid.txt"], "picture suffix"),
    (["--out", "/nonexistent/grid.png"], "does not exist"),
    (["--steps", "0"], "argument --steps: 0 is below 1"),
])
def test_demo_bad_input(argv, words, capsys):
    from tome_compile.shapes.demo import main

    assert main(argv + ["--compiler", "eager"]) == 2
    assert words in capsys.readouterr().err


def test_bootstrap_mean_interval():
    from tome_compile.shapes.metrics import bootstrap_mean

    values = torch.randn(400, generator=torch.Generator().manual_seed(0)) + 3.0
    mean, low, high = bootstrap_mean(values)
    assert low < mean < high and abs(mean - float(values.double().mean())) < 1e-12
    # the normal-theory 95% half-width is 1.96 * sd / sqrt(n) ~ 0.098 here
    assert 0.08 < (high - low) / 2 < 0.12 and low < 3.0 < high
    assert bootstrap_mean(values) == bootstrap_mean(values)  # reproducible
    assert bootstrap_mean(torch.full((10,), 2.0)) == (2.0, 2.0, 2.0)
    with pytest.raises(ValueError, match="finite"):
        bootstrap_mean(torch.tensor([1.0, float("inf")]))


def test_quality_benchmark_tables():
    from tome_compile.shapes.probe import load_probe
    from tome_compile.shapes.quality import format_tables, run_quality

    model = build_model(seed=4).eval()
    prompts, seeds = ["red circle", "blue ring", "green cross", "cyan square"], [0, 1, 2, 3]
    result = run_quality(model, load_probe(), prompts, seeds, ratios=[0.3, 0.5], steps=2, compiler="eager",
                         progress=False, methods=("tome", "importance", "tome-shared-every2", "todo"))
    names = [r["method"] for r in result["rows"]]
    assert names == ["plain", "plain, other seeds", "tome 0.3", "importance 0.3", "tome-shared-every2 0.3",
                     "tome 0.5", "importance 0.5", "tome-shared-every2 0.5", "todo x2"]
    rows = {r["method"]: r for r in result["rows"]}
    for name in names[1:]:
        mean, low, high = rows[name]["psnr_db"]
        assert low <= mean <= high and len(result["per_image"][name]["psnr_db"]) == 4
    # merging keeps pictures much closer to the plain ones than a different seed does
    assert rows["tome 0.3"]["psnr_db"][0] > rows["plain, other seeds"]["psnr_db"][0] + 10
    assert rows["tome 0.3"]["psnr_db"][0] > rows["tome 0.5"]["psnr_db"][0]  # more merging, less fidelity
    assert [(e["variant"], e["ratio"]) for e in result["paired"]] == [
        ("importance", 0.3), ("tome-shared-every2", 0.3), ("importance", 0.5), ("tome-shared-every2", 0.5),
        ("todo x2", 0.5)]  # ToDo (no ratio) against ToMe at its default ratio
    # the second step reuses the first step's plans: not the exact ToMe picture
    assert (
        result["per_image"]["tome-shared-every2 0.3"]["psnr_db"] != result["per_image"]["tome 0.3"]["psnr_db"]
    )
    delta = result["paired"][0]["delta_psnr_db"][0]
    per = result["per_image"]
    expected = (
        sum(a - b for a, b in zip(per["importance 0.3"]["psnr_db"], per["tome 0.3"]["psnr_db"], strict=True))
        / 4
    )
    assert abs(delta - expected) < 1e-9
    table = format_tables(result)
    assert "| todo x2 |" in table and "| todo x2 | 0.5 |" in table
    assert "| tome 0.5 |" in table and "| importance | 0.3 |" in table and "plain, other seeds" in table
    assert "| tome-shared-every2 | 0.5 |" in table


@pytest.mark.parametrize("argv, words", [
    (["--ratios", "0.3", "0.95"], "ratio=0.95"),
    (["--variants", "importance"], "include tome"),
    (["--variants", "tome", "tome-every0"], "plan_every=0"),
    (["--variants", "tome", "tome-often"], "unknown variant"),
    (["--seeds", "0"], "argument --seeds: 0 is below 1"),
    (["--out", "/nonexistent/q.json"], "does not exist"),
])
def test_quality_bad_input(argv, words, capsys):
    from tome_compile.shapes.quality import main

    assert main(argv + ["--compiler", "eager"]) == 2
    assert words in capsys.readouterr().err


def test_demo_with_a_local_diffusers_pipeline(tmp_path, capsys):
    import json

    from conftest import tiny_pipeline_folder

    from tome_compile.shapes.demo import main

    pipe = tiny_pipeline_folder(tmp_path / "p")
    out = tmp_path / "grid.png"
    code = main(["--model", str(pipe), "--size", "16", "--steps", "2", "--seeds", "2", "--prompts", "a cat",
                 "--compiler", "eager", "--out", str(out)])
    printed = capsys.readouterr().out
    assert code == 0 and out.is_file()
    data = json.loads(out.with_suffix(".json").read_text())
    assert data["model"] == str(pipe) and data["rows"] == ["plain", "tome 0.5", "importance 0.5", "todo x2"]
    merged = data["results"][1]
    assert merged["probe_accuracy"] is None and 0 < merged["ssim"] <= 1 and merged["psnr_db"] > 0
    assert "n/a" in printed
    from PIL import Image

    width, height = Image.open(out).size  # 2 pictures per row, 3 rows, 16x16 shown 4x, plus labels
    assert width > 16 * 2 * 4 and height > 16 * 3 * 4


def test_demo_with_a_unet_folder(tmp_path, capsys):
    from tome_compile.shapes.demo import main

    build_model(seed=5).unet.save_pretrained(tmp_path / "unet")
    out = tmp_path / "u.png"
    assert main(["--model", str(tmp_path / "unet"), "--steps", "2", "--seeds", "1", "--prompts", "red circle",
                 "--compiler", "eager", "--out", str(out)]) == 0
    assert out.is_file() and "| importance 0.5 |" in capsys.readouterr().out
    # a U-Net that is not the shapes model's cannot make pictures alone: clear error, nothing written
    from diffusers import UNet2DConditionModel

    UNet2DConditionModel(
        sample_size=8,
        block_out_channels=(32, 64),
        layers_per_block=1,
        cross_attention_dim=32,
        down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"),
        norm_num_groups=8,
        up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"),
    ).save_pretrained(tmp_path / "sd")
    assert (
        main(["--model", str(tmp_path / "sd"), "--compiler", "eager", "--out", str(tmp_path / "x.png")]) == 2
    )
    err = capsys.readouterr().err
    assert "model_index.json" in err and "in_channels" in err
    assert not (tmp_path / "x.png").exists() and not (tmp_path / "x.json").exists()


def test_grid_labels_are_drawn():
    import numpy as np

    from tome_compile.shapes.grid import bare_grid, labelled_grid

    g = torch.Generator().manual_seed(0)
    rows = [torch.rand(3, 3, 8, 8, generator=g) for _ in range(2)]
    bare = np.asarray(bare_grid(rows, scale=4))
    columns = [["red circle", "seed 0"], ["blue ring", "seed 0"], ["cyan cross", "seed 1"]]
    labelled = np.asarray(
        labelled_grid([(["plain"], rows[0]), (["tome 0.5", "1.14x speed"], rows[1])], columns, scale=4)
    )
    left, top = labelled.shape[1] - bare.shape[1], labelled.shape[0] - bare.shape[0]
    assert left > 40 and top > 20  # room for the row labels and the two-line column headers
    assert np.array_equal(labelled[top:, left:], bare)  # the pictures themselves are untouched
    assert (labelled[top:, :left] < 128).any() and (labelled[:top, left:] < 128).any()  # ink: text drawn
    other = np.asarray(labelled_grid([(["plain"], rows[0]), (["importance 0.5", "0.90x speed"], rows[1])],
                                     columns, scale=4))
    assert not np.array_equal(other[top:, :left], labelled[top:, :left])  # it is the label text that shows


def test_demo_out_folder_and_file(tmp_path, capsys):
    from PIL import Image

    from tome_compile.shapes.demo import main

    save_model(build_model(seed=3), tmp_path / "m")
    base = ["--model", str(tmp_path / "m"), "--steps", "1", "--seeds", "1", "--prompts", "red circle",
            "--compiler", "eager"]
    assert main(base + ["--out", str(tmp_path / "results") + "/"]) == 0  # a new folder
    assert sorted(p.name for p in (tmp_path / "results").iterdir()) == ["tome_demo.json", "tome_demo.png"]
    (tmp_path / "existing").mkdir()
    assert main(base + ["--out", str(tmp_path / "existing")]) == 0  # an existing folder, no separator
    assert (tmp_path / "existing" / "tome_demo.png").is_file()
    assert main(base + ["--out", str(tmp_path / "pic.png")]) == 0
    assert (tmp_path / "pic.png").is_file() and (tmp_path / "pic.json").is_file()
    assert Image.open(tmp_path / "pic.png").size[0] > 32 * 4  # one 32x32 picture shown 4x, plus labels
