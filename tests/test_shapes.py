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
    for (k, a), (_, b) in zip(model.state_dict().items(), loaded.state_dict().items()):
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
    accuracy = sum(p == q for p, q in zip(predicted, prompts)) / len(prompts)
    assert accuracy >= 0.95


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
    assert data["rows"] == ["plain", "tome 0.5", "importance 0.5"]
    assert [r["method"] for r in data["results"]] == data["rows"]
    assert data["results"][1]["psnr_db"] > 0 and 0 < data["results"][1]["ssim"] <= 1
    assert "| tome 0.5 |" in printed and "PSNR" in printed


@pytest.mark.parametrize("argv, words", [
    (["--prompts", "purple hexagon"], "must be '<colour> <shape>'"),
    (["--ratio", "0.9"], "ratio=0.9"),
    (["--model", "/nonexistent"], "no model.safetensors"),
])
def test_demo_bad_input(argv, words, capsys):
    from tome_compile.shapes.demo import main

    assert main(argv + ["--compiler", "eager"]) == 2
    assert words in capsys.readouterr().err
