# SPDX-License-Identifier: Apache-2.0
"""TQConfig: validation with errors that name the valid values, and the deprecated TQ_* variables read once."""

import dataclasses
import pickle

import pytest

from turboquant_core.config import KEY_SMOOTHING_MODES, TQConfig, with_deprecated_env


def test_defaults_and_frozen():
    cfg = TQConfig()
    assert (cfg.key_centering, cfg.key_smoothing, cfg.boundary_layers, cfg.attention_workspace_mb,
            cfg.prefill_from_cache, cfg.compile_workers, cfg.decode_kernel, cfg.weights_lm_head,
            cfg.weights_decode_int8) == (True, "auto", 0, 32, False, 0, "auto", False, True)
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.key_centering = False
    assert pickle.loads(pickle.dumps(cfg)) == cfg  # travels to vLLM's worker processes


@pytest.mark.parametrize("kwargs,message", [
    (dict(key_smoothing="1"), "key_smoothing must be one of auto, all, off, got '1'"),
    (dict(key_centering="yes"), "key_centering must be true or false"),
    (dict(boundary_layers=-1), "boundary_layers must be an integer >= 0, got -1"),
    (dict(boundary_layers=True), "boundary_layers must be an integer >= 0"),
    (dict(attention_workspace_mb=0), "attention_workspace_mb must be an integer >= 1, got 0"),
    (dict(prefill_from_cache=1), "prefill_from_cache must be true or false, got 1"),
    (dict(compile_workers=-1), r"compile_workers must be an integer >= 0 \(0: automatic\), got -1"),
    (dict(compile_workers=2.0), "compile_workers must be an integer >= 0"),
    (dict(decode_kernel="mma"), "decode_kernel must be one of auto, register-tile, wgmma, got 'mma'"),
    (dict(weights_lm_head="yes"), "weights_lm_head must be true or false, got 'yes'"),
    (dict(weights_decode_int8=0), "weights_decode_int8 must be true or false, got 0"),
])
def test_bad_values_name_the_valid_ones(kwargs, message):
    with pytest.raises(ValueError, match=message):
        TQConfig(**kwargs)


def test_uuid_is_stable_and_tells_options_apart():
    assert TQConfig().uuid() == TQConfig().uuid()
    assert len({TQConfig(key_smoothing=m).uuid() for m in KEY_SMOOTHING_MODES}) == len(KEY_SMOOTHING_MODES)
    assert TQConfig(prefill_from_cache=True).uuid() != TQConfig().uuid()
    assert TQConfig(compile_workers=1).uuid() != TQConfig().uuid()
    assert TQConfig(decode_kernel="wgmma").uuid() != TQConfig().uuid()
    assert TQConfig(weights_lm_head=True).uuid() != TQConfig().uuid()
    assert TQConfig(weights_decode_int8=False).uuid() != TQConfig().uuid()


def test_from_vllm_reads_the_cache_config_and_falls_back_to_defaults():
    import types

    cfg = TQConfig(key_centering=False)
    assert TQConfig.from_vllm(types.SimpleNamespace(cache_config=types.SimpleNamespace(turboquant=cfg))) is cfg
    assert TQConfig.from_vllm(types.SimpleNamespace(cache_config=types.SimpleNamespace())) == TQConfig()
    assert TQConfig.from_vllm(None) == TQConfig()


def test_deprecated_env_applies_where_the_option_has_its_default():
    env = {"TQ_KEY_CENTERING": "0", "TQ_KEY_SMOOTHING": "1", "TQ_BOUNDARY_LAYERS": "2", "TQ_ATTN_WORKSPACE_MB": "64",
           "UNRELATED": "x"}
    got, warnings = with_deprecated_env(TQConfig(), env)
    assert got == TQConfig(key_centering=False, key_smoothing="all", boundary_layers=2, attention_workspace_mb=64)
    assert len(warnings) == 4
    assert any("TQ_KEY_SMOOTHING=1 is deprecated" in w and "--tq-key-smoothing" in w for w in warnings)
    # An option set on the command line wins, and the warning says the variable is ignored.
    got, warnings = with_deprecated_env(TQConfig(boundary_layers=1), {"TQ_BOUNDARY_LAYERS": "2"})
    assert got.boundary_layers == 1 and "ignored" in warnings[0] and "--tq-boundary-layers" in warnings[0]
    # Nothing set: the same object, no warning.
    cfg = TQConfig()
    assert with_deprecated_env(cfg, {}) == (cfg, [])


@pytest.mark.parametrize("env,message", [
    ({"TQ_KEY_CENTERING": "yes"}, r"TQ_KEY_CENTERING \(deprecated: use --tq-key-centering.*\) must be one of 1, 0"),
    ({"TQ_BOUNDARY_LAYERS": "two"}, r"TQ_BOUNDARY_LAYERS \(deprecated: use --tq-boundary-layers N\) must be an int"),
    ({"TQ_BOUNDARY_LAYERS": "-3"}, "boundary_layers must be an integer >= 0, got -3"),
])
def test_bad_deprecated_values_are_errors(env, message):
    with pytest.raises(ValueError, match=message):
        with_deprecated_env(TQConfig(), env)
