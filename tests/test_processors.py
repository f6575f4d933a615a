"""#35: self-attention is found by what it computes, whatever processor wraps it. Processors that
users and libraries install — a PEFT LoRA on the projections, IP-Adapter's image K/V on the
cross-attention, a processor that is itself an ``nn.Module`` around ``AttnProcessor2_0`` — leave
the sites rewritten where tomesd would merge, with tomesd's numbers. (Zero123++'s own reference
processor: tests/test_zero123.py.)"""

from __future__ import annotations

import pytest
import torch
from conftest import call, compiled, tiny_inputs, tiny_unet, tomesd_reference

SD15_SELF = ["down_blocks.0.attentions.0.transformer_blocks.0.attn1",
             "up_blocks.1.attentions.0.transformer_blocks.0.attn1",
             "up_blocks.1.attentions.1.transformer_blocks.0.attn1"]


def report(backend):
    (result,) = backend.reports
    return result


def lora_unet():
    """The tiny U-Net with a PEFT LoRA on q, k, v and the output projection (B not zero: the
    adapter changes the output), as ``unet.add_adapter`` / ``load_lora_weights`` install it."""
    pytest.importorskip("peft")
    from peft import LoraConfig

    unet = tiny_unet()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(1)
        unet.add_adapter(LoraConfig(r=4, lora_alpha=8, init_lora_weights=False,
                                    target_modules=["to_q", "to_k", "to_v", "to_out.0"]))
    return unet.eval()


def test_a_peft_lora_on_the_projections_is_merged_as_tomesd_merges_it():
    unet = lora_unet()
    to_q = unet.down_blocks[0].attentions[0].transformer_blocks[0].attn1.to_q
    assert type(to_q).__module__.startswith("peft")
    inputs = tiny_inputs(unet)
    model, backend = compiled(unet, ratio=0.5, use_rand=False)
    ours = call(model, inputs)
    result = report(backend)
    assert [s.path for s in result.rewritten] == SD15_SELF
    assert all(s.tokens == 256 and s.tokens_after == 128 for s in result.rewritten)
    assert result.count_nodes("merge") == result.count_nodes("unmerge") == 3
    expected = call(tomesd_reference(unet, ratio=0.5, use_rand=False), inputs)
    assert (ours - expected).abs().max() < 1e-5
    plain = call(unet, inputs)
    assert (ours - plain).abs().max() > 1e-3
    # negative: the adapter counts (the same U-Net without it merges to other numbers)
    unet.disable_adapters()
    assert (call(unet, inputs) - plain).abs().max() > 1e-3


def test_todo_downsamples_the_lora_branch_of_keys_and_values_too():
    """ToDo feeds the downsampled grid to every node of the k / v projections that reads the
    attention input: the base layer and ``lora_A``. Reference: the paper's pre-hooks on the LoRA
    wrappers ``to_k`` / ``to_v`` (tests/test_todo.py)."""
    from test_todo import todo_reference

    unet = lora_unet()
    inputs = tiny_inputs(unet)
    model, backend = compiled(unet, method="todo")
    ours = call(model, inputs)
    assert [s.path for s in report(backend).rewritten] == SD15_SELF
    assert (ours - call(todo_reference(unet), inputs)).abs().max() < 1e-5


def ip_adapter_unet():
    """The tiny U-Net as ``load_ip_adapter`` leaves it: ``IPAdapterAttnProcessor2_0`` (a module with
    ``to_k_ip`` / ``to_v_ip``) on every cross-attention, ``AttnProcessor2_0`` on self-attention, the
    image projection as ``encoder_hid_proj`` (the state built here, random, instead of loaded)."""
    from diffusers.models.attention_processor import AttnProcessor2_0, IPAdapterAttnProcessor2_0
    from diffusers.models.embeddings import ImageProjection, MultiIPAdapterImageProjection

    unet = tiny_unet()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(2)
        processors = {}
        for name in unet.attn_processors:
            block = name.split(".")[0]
            width = unet.config.block_out_channels[-1 if block == "mid_block" else
                                                   int(name.split(".")[1]) if block == "down_blocks" else
                                                   -1 - int(name.split(".")[1])]
            processors[name] = (AttnProcessor2_0() if name.endswith("attn1.processor") else
                                IPAdapterAttnProcessor2_0(width, 32, num_tokens=(4,), scale=0.7))
        unet.set_attn_processor(processors)
        unet.encoder_hid_proj = MultiIPAdapterImageProjection(
            [ImageProjection(cross_attention_dim=32, image_embed_dim=16, num_image_text_embeds=4)])
        unet.config.encoder_hid_dim_type = "ip_image_proj"
        for p in unet.attn_processors.values():
            if isinstance(p, torch.nn.Module):
                for w in p.parameters():
                    w.data.normal_(0, 0.2)
    return unet.eval()


class _WithImage:
    """Inputs plus IP-Adapter's image embeddings (``added_cond_kwargs={"image_embeds": [...]}``)."""

    def __init__(self, inputs, image):
        self.inputs, self.image = inputs, image

    def kwargs(self):
        return {**self.inputs.kwargs(), "added_cond_kwargs": {"image_embeds": [self.image]}}


@pytest.mark.parametrize("crossattn", [False, True])
def test_ip_adapters_image_branch_does_not_hide_the_sites(crossattn):
    """Self-attention merged as tomesd merges it; with ``merge_crossattn`` the cross-attention's
    two attention ops (text K/V, image K/V) are one site, merged once."""
    unet = ip_adapter_unet()
    inputs = _WithImage(tiny_inputs(unet), torch.randn(2, 1, 16, generator=torch.Generator().manual_seed(5)))
    model, backend = compiled(unet, ratio=0.5, use_rand=False, merge_crossattn=crossattn)
    ours = call(model, inputs)
    result = report(backend)
    own = [s for s in result.rewritten if s.kind == "self-attention"]
    assert [s.path for s in own] == SD15_SELF
    assert all(s.targets == (("attn1", "attn2") if crossattn else ("attn1",)) for s in own)
    cross = [s for s in result.sites if s.kind == "cross-attention"]  # one site each, two attention ops
    assert len(cross) == 4
    assert [s.path for s in cross if s.rewritten] == ([p.replace("attn1", "attn2") for p in SD15_SELF]
                                                      if crossattn else [])
    expected = call(tomesd_reference(unet, ratio=0.5, use_rand=False, merge_crossattn=crossattn), inputs)
    assert (ours - expected).abs().max() < 1e-5
    plain = call(unet, inputs)
    assert (ours - plain).abs().max() > 1e-3
    # the image branch is live: other image embeddings, other output
    other = _WithImage(inputs.inputs, torch.zeros(2, 1, 16))
    assert (call(model, other) - ours).abs().max() > 1e-4


class GainProcessor(torch.nn.Module):
    """A user's processor: a module (a learnt gain) around diffusers' ``AttnProcessor2_0``, so its
    nodes sit under ``attn1.processor`` in the module path."""

    def __init__(self):
        super().__init__()
        from diffusers.models.attention_processor import AttnProcessor2_0

        self.inner = AttnProcessor2_0()
        self.gain = torch.nn.Parameter(torch.tensor(1.25))

    def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None, **kwargs):
        return self.inner(attn, hidden_states, encoder_hidden_states, attention_mask) * self.gain


def test_a_processor_module_around_attn_processor_2_0_is_merged():
    unet = tiny_unet()
    unet.set_attn_processor({name: GainProcessor() for name in unet.attn_processors})
    inputs = tiny_inputs(unet)
    model, backend = compiled(unet, ratio=0.5, use_rand=False)
    ours = call(model, inputs)
    result = report(backend)
    assert [s.path for s in result.rewritten] == SD15_SELF  # the attention module, not "attn1.processor"
    expected = call(tomesd_reference(unet, ratio=0.5, use_rand=False), inputs)
    assert (ours - expected).abs().max() < 1e-5
    assert (ours - call(unet, inputs)).abs().max() > 1e-3


class KeepingProcessor(GainProcessor):
    """A processor that keeps a value computed inside the attention for later (as attention-map
    stores do): merging would keep it at the merged token count."""

    def __init__(self):
        super().__init__()
        self.kept = []

    def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None, **kwargs):
        self.kept.append(attn.to_q(hidden_states))
        return super().__call__(attn, hidden_states, encoder_hidden_states, attention_mask)


def test_a_region_that_hands_out_another_value_is_skipped_with_the_node_named():
    """Negative case: the reason names the node that breaks the pattern, not a count of outputs."""
    unet = tiny_unet()
    unet.set_attn_processor({name: GainProcessor() for name in unet.attn_processors})
    unet.down_blocks[0].attentions[0].transformer_blocks[0].attn1.processor = KeepingProcessor()
    inputs = tiny_inputs(unet)
    model, backend = compiled(unet, ratio=0.5, use_rand=False)
    call(model, inputs)
    keeping = model._orig_mod.down_blocks[0].attentions[0].transformer_blocks[0].attn1.processor
    result = report(backend)
    assert [s.path for s in result.rewritten] == SD15_SELF[1:]
    (kept,) = [s for s in result.sites if s.path == SD15_SELF[0]]
    assert not kept.rewritten
    assert kept.reason.startswith("its region hands out ") and "attn1.to_q" in kept.reason
    assert kept.reason.endswith("besides its output")
    assert len(keeping.kept) == 1 and keeping.kept[0].shape == (2, 256, 32)  # kept whole
