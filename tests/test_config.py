from __future__ import annotations

import dataclasses
import inspect

import pytest

from tome_compile import ToMeConfig, ToMeConfigError, tome_backend


def test_defaults_are_tomesd_defaults():
    import tomesd

    params = inspect.signature(tomesd.apply_patch).parameters
    config = ToMeConfig()
    for name in ("ratio", "max_downsample", "sx", "sy", "use_rand", "merge_attn", "merge_crossattn",
                 "merge_mlp"):
        assert getattr(config, name) == params[name].default, name
    assert config.seed is None and config.method == "tome"


def test_config_is_frozen():
    with pytest.raises(dataclasses.FrozenInstanceError):
        ToMeConfig().ratio = 0.3  # type: ignore[misc]


@pytest.mark.parametrize(
    "kwargs, words",
    [
        (dict(ratio=0.8), ["ratio=0.8", "0.75"]),
        (dict(ratio=-0.1), ["ratio=-0.1", "[0, 0.75]"]),
        (dict(ratio=0.9, sx=4, sy=4), None),  # limit 1 - 1/16 = 0.9375: valid
        (dict(max_downsample=3), ["max_downsample=3", "(1, 2, 4, 8)"]),
        (dict(sx=0), ["sx=0", ">= 1"]),
        (dict(sy=-1), ["sy=-1"]),
        (dict(method="fast"), ["method='fast'", "tome", "importance"]),
        (dict(use_rand="yes"), ["use_rand='yes'"]),
        (dict(seed=1.5), ["seed=1.5"]),
        (dict(method="importance", ratio=0.85, sx=4, sy=4), ["ratio=0.85", "dst_fraction=0.25"]),
    ],
)
def test_bad_values_give_one_clear_error(kwargs, words):
    if words is None:
        ToMeConfig(**kwargs)
        return
    with pytest.raises(ToMeConfigError) as info:
        ToMeConfig(**kwargs)
    assert isinstance(info.value, ValueError)
    for word in words:
        assert word in str(info.value)


def test_backend_validates_too():
    with pytest.raises(ToMeConfigError, match="ratio=0.8"):
        tome_backend(0.8)
    with pytest.raises(ToMeConfigError, match="unknown option"):
        tome_backend(0.5, rato=0.3)
    with pytest.raises(ToMeConfigError, match="compiler='nope'"):
        tome_backend(0.5, compiler="nope")


def test_backend_accepts_a_config():
    config = ToMeConfig(ratio=0.3, max_downsample=2)
    assert tome_backend(config).config is config
    assert tome_backend(config, seed=4).config == config.replace(seed=4)


def test_enabled():
    assert not ToMeConfig(ratio=0).enabled
    assert not ToMeConfig(merge_attn=False).enabled
    assert ToMeConfig(merge_attn=False, merge_mlp=True).enabled
