# SPDX-License-Identifier: Apache-2.0
"""The patched vLLM config layer, without a GPU: --kv-cache-dtype choices, CacheConfig validation,
KV-cache specs priced by turboquant_core's format table, the backend's cache shape, and the
load-time key-smoothing hook (0008) on vLLM's own norm and RoPE modules, the TurboQuant options (0002).

Runs only where a vLLM 0.26.0 patched by scripts/patches.py is importable (see
vllm_patches/README.md for the CPU recipe); skips otherwise, saying why.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from turboquant_core.formats import KV_FORMATS, get_format

PATCH_MARKER = "_aither_tq_patches.txt"
NEW_FORMATS = [name for name, fmt in KV_FORMATS.items() if fmt.origin == "new"]


def _patched_vllm_dir() -> Path:
    spec = importlib.util.find_spec("vllm")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("vllm is not installed (CPU recipe: vllm_patches/README.md)")
    pkg = Path(list(spec.submodule_search_locations)[0])
    if not (pkg / PATCH_MARKER).is_file():
        pytest.skip(f"vllm at {pkg} is not patched: run `python scripts/patches.py apply --installed`")
    return pkg


def _select_cpu_platform_if_none_detected() -> None:
    """vLLM's CUDA wheel on a machine without a GPU detects no platform ("unspecified"), and its
    DeviceConfig (built while EngineArgs collects defaults) then refuses to start. vLLM's own CPU
    platform describes such a machine, so select it explicitly, as vLLM's CPU build does itself."""
    import vllm.platforms as platforms

    if "current_platform" in vars(platforms):
        return  # chosen already
    if platforms.resolve_current_platform_cls_qualname().endswith(".UnspecifiedPlatform"):
        from vllm.platforms.cpu import CpuPlatform

        platforms.current_platform = CpuPlatform()


def _patched_imports(what: str, *modules: str) -> list:
    """The named modules of the patched vLLM (or of turboquant_core's glue over it) on the CPU platform; skips,
    saying which part did not import, where a dependency is missing."""
    import importlib

    _patched_vllm_dir()
    try:
        _select_cpu_platform_if_none_detected()
        return [importlib.import_module(m) for m in modules]
    except ImportError as e:
        pytest.skip(f"patched vllm is installed but {what} does not import: {e}")


@pytest.fixture(scope="module")
def vllm_modules():
    _patched_vllm_dir()
    try:
        _select_cpu_platform_if_none_detected()
        from vllm.config import CacheConfig
        from vllm.engine import arg_utils
        from vllm.utils.argparse_utils import FlexibleArgumentParser
    except ImportError as e:  # a dependency of vLLM's config layer is missing
        pytest.skip(f"patched vllm is installed but its config layer does not import: {e}")
    return CacheConfig, arg_utils, FlexibleArgumentParser


@pytest.fixture(scope="module")
def parser(vllm_modules):
    _, arg_utils, flexible_parser = vllm_modules
    return arg_utils.EngineArgs.add_cli_args(flexible_parser())


@pytest.mark.parametrize("name", ["turboquant_k3v4_nc", *NEW_FORMATS])
def test_cli_accepts_turboquant_dtypes(parser, name):
    assert parser.parse_args(["--kv-cache-dtype", name]).kv_cache_dtype == name


def test_cli_rejects_unknown_turboquant_dtype(parser, capsys):
    with pytest.raises(SystemExit) as exc:
        parser.parse_args(["--kv-cache-dtype", "turboquant_bogus"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "turboquant_bogus" in err and "invalid choice" in err
    assert all(name in err for name in KV_FORMATS)  # the valid choices are listed


@pytest.mark.parametrize("name", list(KV_FORMATS))
def test_cache_config_accepts_every_format(vllm_modules, name):
    cache_config_cls = vllm_modules[0]
    assert cache_config_cls(cache_dtype=name).cache_dtype == name


def test_cache_config_rejects_unknown_turboquant_name(vllm_modules):
    cache_config_cls = vllm_modules[0]
    with pytest.raises(ValueError) as exc:
        cache_config_cls(cache_dtype="turboquant_bogus")
    msg = str(exc.value)
    assert "turboquant_bogus" in msg and "valid formats" in msg
    assert all(name in msg for name in KV_FORMATS)


def test_cache_dtype_literal_matches_format_table(vllm_modules):
    import typing

    from vllm.config.cache import CacheDType
    from vllm.utils.torch_utils import STR_DTYPE_TO_TORCH_DTYPE

    names = {n for n in typing.get_args(CacheDType) if n.startswith("turboquant_")}
    assert names == set(KV_FORMATS)
    import torch

    assert all(STR_DTYPE_TO_TORCH_DTYPE[n] is torch.uint8 for n in KV_FORMATS)


TQ_ENV = ("TQ_KEY_CENTERING", "TQ_KEY_SMOOTHING", "TQ_BOUNDARY_LAYERS", "TQ_ATTN_WORKSPACE_MB")


@pytest.fixture
def no_tq_env(monkeypatch):
    for var in TQ_ENV:
        monkeypatch.delenv(var, raising=False)
    return monkeypatch


def _tq_config(parser, arg_utils, argv):
    # create_tq_config reads only the tq_* arguments; called on the parsed namespace, it skips EngineArgs' other
    # post-processing (which looks up the default model).
    return arg_utils.EngineArgs.create_tq_config(parser.parse_args(argv))


def test_turboquant_options_from_the_command_line(parser, vllm_modules, no_tq_env):
    from turboquant_core.config import TQConfig

    arg_utils = vllm_modules[1]
    assert _tq_config(parser, arg_utils, []) == TQConfig()
    got = _tq_config(parser, arg_utils, ["--kv-cache-dtype", "turboquant_k3v4_nc", "--no-tq-key-centering",
                                         "--tq-key-smoothing", "all", "--tq-boundary-layers", "2",
                                         "--tq-attention-workspace-mb", "64", "--tq-prefill-from-cache",
                                         "--tq-compile-workers", "1", "--tq-decode-kernel", "wgmma"])
    assert got == TQConfig(key_centering=False, key_smoothing="all", boundary_layers=2, attention_workspace_mb=64,
                           prefill_from_cache=True, compile_workers=1, decode_kernel="wgmma")
    with pytest.raises(ValueError, match="boundary_layers must be an integer >= 0"):
        _tq_config(parser, arg_utils, ["--tq-boundary-layers", "-1"])
    with pytest.raises(ValueError, match="compile_workers must be an integer >= 0"):
        _tq_config(parser, arg_utils, ["--tq-compile-workers", "-2"])
    got = _tq_config(parser, arg_utils, ["--quantization", "tq4", "--tq-weights-lm-head"])
    assert got == TQConfig(weights_lm_head=True)
    for argv in ([], ["--quantization", "fp8"]):  # the head is encoded only by --quantization tq3|tq4
        with pytest.raises(ValueError, match="--tq-weights-lm-head encodes the output head with --quantization tq"):
            _tq_config(parser, arg_utils, argv + ["--tq-weights-lm-head"])
    # the decode products' int8 applies to tq checkpoints as well: no --quantization needed
    assert _tq_config(parser, arg_utils, ["--no-tq-weights-decode-int8"]) == TQConfig(weights_decode_int8=False)


def test_turboquant_options_in_help_with_their_choices(parser, capsys):
    with pytest.raises(SystemExit):
        parser.parse_args(["--help=CacheConfig"])
    out = capsys.readouterr().out
    for option in ("--tq-key-centering", "--no-tq-key-centering", "--tq-key-smoothing", "--tq-boundary-layers",
                   "--tq-attention-workspace-mb", "--tq-prefill-from-cache", "--no-tq-prefill-from-cache",
                   "--tq-compile-workers", "--tq-decode-kernel", "--tq-weights-lm-head", "--no-tq-weights-lm-head",
                   "--tq-weights-decode-int8", "--no-tq-weights-decode-int8"):
        assert option in out
    assert "{auto,all,off}" in out and "{auto,register-tile,wgmma}" in out
    with pytest.raises(SystemExit) as exc:
        parser.parse_args(["--tq-key-smoothing", "1"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "invalid choice" in err and "auto" in err and "all" in err and "off" in err
    with pytest.raises(SystemExit) as exc:
        parser.parse_args(["--tq-decode-kernel", "mma"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "invalid choice" in err and "auto" in err and "wgmma" in err


def test_deprecated_environment_is_read_once_with_a_warning(parser, vllm_modules, no_tq_env):
    arg_utils = vllm_modules[1]
    log = []
    no_tq_env.setattr(arg_utils, "logger", type("L", (), {"warning": staticmethod(log.append)}))
    no_tq_env.setenv("TQ_KEY_CENTERING", "0")
    no_tq_env.setenv("TQ_BOUNDARY_LAYERS", "2")
    got = _tq_config(parser, arg_utils, ["--tq-boundary-layers", "1"])  # the option wins over the variable
    assert got.key_centering is False and got.boundary_layers == 1
    assert any("TQ_KEY_CENTERING=0 is deprecated" in w and "--tq-key-centering" in w for w in log)
    assert any("TQ_BOUNDARY_LAYERS=2 is deprecated and ignored" in w for w in log)
    no_tq_env.setenv("TQ_KEY_SMOOTHING", "maybe")
    with pytest.raises(ValueError, match="TQ_KEY_SMOOTHING .*--tq-key-smoothing.*auto, 1, 0"):
        _tq_config(parser, arg_utils, [])


def test_cache_config_carries_the_options_outside_the_compile_hash(vllm_modules):
    from turboquant_core.config import TQConfig

    cache_config_cls = vllm_modules[0]
    default = cache_config_cls(cache_dtype="turboquant_k3v4_nc")
    assert default.turboquant == TQConfig()
    off = cache_config_cls(cache_dtype="turboquant_k3v4_nc", turboquant=TQConfig(key_centering=False))
    assert off.turboquant.key_centering is False
    assert off.compute_hash() == default.compute_hash()
    with pytest.raises(ValueError, match="key_smoothing must be one of auto, all, off"):
        cache_config_cls(cache_dtype="turboquant_k3v4_nc", turboquant=TQConfig(key_smoothing="1"))


@pytest.mark.parametrize("name", list(KV_FORMATS))
@pytest.mark.parametrize("head_size", [64, 80, 128, 256])
def test_specs_priced_by_format_table(vllm_modules, name, head_size):
    import torch
    from vllm.model_executor.layers.quantization.turboquant.config import tq_slot_size
    from vllm.v1.kv_cache_interface import TQFullAttentionSpec, is_tq_attention_spec

    from turboquant_core.vllm.spec import TQSlidingWindowSpec

    slot = tq_slot_size(name, head_size)
    assert slot == get_format(name).bytes_per_token_per_head(head_size)
    common = dict(block_size=32, num_kv_heads=3, head_size=head_size, dtype=torch.uint8, tq_slot_size=slot)
    full = TQFullAttentionSpec(head_size_v=head_size, **common)
    sliding = TQSlidingWindowSpec(sliding_window=512, **common)
    assert full.page_size_bytes == sliding.page_size_bytes == 32 * 3 * slot
    assert is_tq_attention_spec(full) and is_tq_attention_spec(sliding)


def test_sliding_spec_registration_and_fallback(vllm_modules):
    import torch
    from vllm.v1.core.kv_cache_utils import unify_hybrid_kv_cache_specs
    from vllm.v1.core.single_type_kv_cache_manager import FullAttentionManager, SlidingWindowManager
    from vllm.v1.kv_cache_interface import TQFullAttentionSpec
    from vllm.v1.kv_cache_spec_registry import KVCacheSpecRegistry

    from turboquant_core.vllm.spec import TQSlidingWindowSpec

    common = dict(block_size=16, num_kv_heads=1, head_size=256, dtype=torch.uint8, tq_slot_size=228)
    sliding = TQSlidingWindowSpec(sliding_window=512, **common)
    full = TQFullAttentionSpec(head_size_v=256, **common)
    KVCacheSpecRegistry._ensure_registered()
    assert KVCacheSpecRegistry.get_manager_class(sliding) is SlidingWindowManager
    assert KVCacheSpecRegistry.get_manager_class(full) is FullAttentionManager

    # Hybrid manager disabled: sliding layers become full-attention specs that keep
    # the TurboQuant page size and their window.
    specs = {"layers.0.attn": sliding, "layers.5.attn": full}
    unify_hybrid_kv_cache_specs(specs)
    converted = specs["layers.0.attn"]
    assert isinstance(converted, TQFullAttentionSpec)
    assert converted.sliding_window == 512 and converted.page_size_bytes == full.page_size_bytes


def test_backend_cache_shape(vllm_modules):
    pytest.importorskip("triton")
    try:
        from vllm.v1.attention.backends.registry import AttentionBackendEnum

        from turboquant_core.vllm.backend import TQAttentionBackend
    except ImportError as e:
        pytest.skip(f"the TurboQuant backend module does not import here: {e}")
    from turboquant_core.ops.paged import paged_layout

    assert AttentionBackendEnum.TURBOQUANT.get_path() == "turboquant_core.vllm.backend.TQAttentionBackend"
    assert AttentionBackendEnum.TURBOQUANT.get_class() is TQAttentionBackend
    assert TQAttentionBackend.get_name() == "TURBOQUANT"
    for name in KV_FORMATS:
        for block_size in TQAttentionBackend.get_supported_kernel_block_sizes():
            shape = TQAttentionBackend.get_kv_cache_shape(7, block_size, 4, 128, name)
            assert shape == (7, 4, paged_layout(name, 128, block_size).head_page_bytes)
            # The page the spec prices is the page the backend allocates.
            assert shape[1] * shape[2] == block_size * 4 * get_format(name).bytes_per_token_per_head(128)
    with pytest.raises(ValueError, match="turboquant_"):
        TQAttentionBackend.get_kv_cache_shape(7, 16, 4, 128, "auto")
    assert TQAttentionBackend.supports_kv_cache_dtype("turboquant_2bit_nc")
    assert not TQAttentionBackend.supports_kv_cache_dtype("fp8")
    assert TQAttentionBackend.supports_sliding_window()


# ----------------------------------------------------------------------------------------------
# 0008: key smoothing folded in by BaseModelLoader.load_model
# ----------------------------------------------------------------------------------------------


class _Recorder:
    def __init__(self):
        self.lines = []

    def info(self, msg, *args):
        self.lines.append(msg % args)


@pytest.fixture
def loader_modules(vllm_modules):
    import torch

    try:
        from vllm.config import VllmConfig, set_current_vllm_config
        from vllm.model_executor.layers.layernorm import GemmaRMSNorm, RMSNorm
        from vllm.model_executor.layers.rotary_embedding import get_rope
        from vllm.model_executor.model_loader import base_loader
    except ImportError as e:
        pytest.skip(f"patched vllm's model loader does not import here: {e}")
    dtype = torch.get_default_dtype()
    torch.set_default_dtype(torch.float32)
    try:
        with set_current_vllm_config(VllmConfig()):  # vLLM's CustomOps read it when built
            yield base_loader, RMSNorm, GemmaRMSNorm, get_rope
    finally:
        torch.set_default_dtype(dtype)


def _vllm_style_model(rms_norm, gemma_rms_norm, get_rope):
    """Three decoder layers with vLLM's own norm and RoPE modules and the attribute names of vLLM
    0.26's Llama / Gemma 3 attention (fused qkv_proj, q_size, kv_size, ...): Llama style (RMSNorm,
    bias, no q/k norm), Gemma 3 style (GemmaRMSNorm input and q/k norms), and one with GPT-J style
    (interleaved) RoPE, which must be left alone."""
    import torch

    g = torch.Generator().manual_seed(0)
    hidden, n_q, n_kv, d = 48, 4, 2, 32

    def layer(norm_cls, qk_norm, neox):
        attn = torch.nn.Module()
        attn.num_heads, attn.num_kv_heads, attn.head_dim = n_q, n_kv, d
        attn.q_size, attn.kv_size = n_q * d, n_kv * d
        attn.qkv_proj = torch.nn.Linear(hidden, (n_q + 2 * n_kv) * d, bias=not qk_norm)
        attn.rotary_emb = get_rope(d, max_position=64, is_neox_style=neox, dtype=torch.float32)
        if qk_norm:
            attn.q_norm, attn.k_norm = norm_cls(d), norm_cls(d)
        out = torch.nn.Module()
        out.self_attn, out.input_layernorm = attn, norm_cls(hidden)
        with torch.no_grad():
            for name, prm in out.named_parameters():
                prm.copy_(torch.rand(prm.shape, generator=g) * 2 if "norm" in name else
                          torch.randn(prm.shape, generator=g) * 0.3)
        return out

    model = torch.nn.Module()
    model.layers = torch.nn.ModuleList([layer(rms_norm, False, True), layer(gemma_rms_norm, True, True),
                                        layer(rms_norm, False, False)])
    return model


def _logits(layer, hidden):
    """q.k after vLLM's q/k norms and RoPE (forward_native), per query head."""
    import torch

    a = layer.self_attn
    x = layer.input_layernorm.forward_native(hidden)
    q, k, _ = a.qkv_proj(x).split([a.q_size, a.kv_size, a.kv_size], dim=-1)
    if hasattr(a, "q_norm"):
        q = a.q_norm.forward_native(q.unflatten(-1, (a.num_heads, a.head_dim))).flatten(-2)
        k = a.k_norm.forward_native(k.unflatten(-1, (a.num_kv_heads, a.head_dim))).flatten(-2)
    q, k = a.rotary_emb.forward_native(torch.arange(hidden.shape[0]), q, k)
    q, k = q.unflatten(-1, (a.num_heads, a.head_dim)), k.unflatten(-1, (a.num_kv_heads, a.head_dim))
    k = k.repeat_interleave(a.num_heads // a.num_kv_heads, dim=1)
    return torch.einsum("thd,shd->hts", q, k)


def _engine(smoothing: str, lora=None):
    """The parts of a VllmConfig that key smoothing reads."""
    import types

    from turboquant_core.config import TQConfig

    return types.SimpleNamespace(cache_config=types.SimpleNamespace(turboquant=TQConfig(key_smoothing=smoothing)),
                                 lora_config=lora)


def test_key_smoothing_hook_in_load_model(loader_modules, monkeypatch):
    import inspect

    import torch

    from turboquant_core.vllm import key_smoothing

    base_loader, rms_norm, gemma_rms_norm, get_rope = loader_modules
    src = inspect.getsource(base_loader.BaseModelLoader.load_model)
    assert 'startswith("turboquant_")' in src
    assert src.index("tq_key_smoothing(model, vllm_config)") < src.index("process_weights_after_loading(")

    log = _Recorder()
    monkeypatch.setattr(key_smoothing, "logger", log)
    monkeypatch.setenv("TQ_KEY_SMOOTHING", "1")  # deprecated: never read here (only when the engine config is made)
    model = _vllm_style_model(rms_norm, gemma_rms_norm, get_rope)
    hidden = torch.randn(12, 48, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        before_state = {k: v.clone() for k, v in model.state_dict().items()}
        before = [_logits(layer, hidden) for layer in model.layers]

        key_smoothing.tq_key_smoothing(model, _engine("off"))
        assert all(torch.equal(v, before_state[k]) for k, v in model.state_dict().items())
        assert log.lines == ["TurboQuant key smoothing: off (--tq-key-smoothing off)"]

        # auto (the default): only the layer with q/k-norm gains; the Llama-style layer 0 is left alone.
        key_smoothing.tq_key_smoothing(model, _engine("auto"))
        line = log.lines[-1]
        assert line.startswith("TurboQuant key smoothing (auto): 1 of 3 decoder layers smoothed"), line
        assert "no q/k norms, and folding into the qkv_proj rows is off (first layers.0)" in line
        state = model.state_dict()
        changed = {k for k, v in state.items() if not torch.equal(v, before_state[k])}
        assert changed == {"layers.1.self_attn.q_norm.weight", "layers.1.self_attn.k_norm.weight"}
        for layer, ref in zip(model.layers, before):
            torch.testing.assert_close(_logits(layer, hidden), ref, rtol=1e-5, atol=1e-5 * ref.abs().max().item())

    # all: the qkv_proj rows of layers without q/k norms too.
    model = _vllm_style_model(rms_norm, gemma_rms_norm, get_rope)
    with torch.no_grad():
        before_state = {k: v.clone() for k, v in model.state_dict().items()}
        before = [_logits(layer, hidden) for layer in model.layers]
        key_smoothing.tq_key_smoothing(model, _engine("all"))
        line = log.lines[-1]
        assert line.startswith("TurboQuant key smoothing (all): 2 of 3 decoder layers smoothed; skipped: 1 x RoPE "
                               "is not rotate-half"), line
        assert "(first layers.2)" in line
        for layer, ref in zip(model.layers, before):
            after = _logits(layer, hidden)
            torch.testing.assert_close(after, ref, rtol=1e-5, atol=1e-5 * ref.abs().max().item())
        state = model.state_dict()
        changed = {k for k, v in state.items() if not torch.equal(v, before_state[k])}
        assert changed == {"layers.0.self_attn.qkv_proj.weight", "layers.0.self_attn.qkv_proj.bias",
                           "layers.1.self_attn.q_norm.weight", "layers.1.self_attn.k_norm.weight"}

    # With LoRA, even `all` puts scales only into q/k norm gains (adapters on qkv_proj would not see scaled rows).
    model = _vllm_style_model(rms_norm, gemma_rms_norm, get_rope)
    key_smoothing.tq_key_smoothing(model, _engine("all", lora=object()))
    assert log.lines[-1].startswith("TurboQuant key smoothing (all): 1 of 3 decoder layers smoothed")


def test_every_glue_module_imports_under_the_patched_vllm(vllm_modules):
    pytest.importorskip("triton")
    from turboquant_core.vllm import backend, centering, key_smoothing, spec, warmup

    assert spec.TQSlidingWindowSpec.__module__ == "turboquant_core.vllm.spec"
    assert backend.TQAttentionBackend.get_name() == "TURBOQUANT"
    # vLLM resolves the warm-up and the backend through these names (patches 0003 and 0007).
    assert warmup.warmup_tq_attention.__module__ == "turboquant_core.vllm.warmup"
    assert centering.attach_key_centering.__module__ == "turboquant_core.vllm.centering"
    assert key_smoothing.tq_key_smoothing.__module__ == "turboquant_core.vllm.key_smoothing"
