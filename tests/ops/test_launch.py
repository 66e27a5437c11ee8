# SPDX-License-Identifier: Apache-2.0
"""ops.launch: the launch-site cache keys on what Triton specializes on, and a cached launch runs the kernel that
Triton's own launch would pick."""

import itertools

import pytest
import torch
import triton
import triton.language as tl

from turboquant_core.ops.launch import arg_key, kwargs_key, launch


def _values():
    t = torch.zeros(64, dtype=torch.float16)
    ints = [0, 1, 2, 15, 16, 17, 32, 48, (1 << 31) - 16, (1 << 31) - 1, 1 << 31, 1 << 32, 1 << 40, (1 << 63) - 16,
            1 << 63, -1, -16, -17, -(1 << 31), -(1 << 31) - 1, -(1 << 31) - 16]
    tensors = [t, t[1:], t[8:], t[16:], t.view(torch.int16), t.view(torch.int16)[3:], t.float(), t.float()[1:],
               t.to(torch.bfloat16), t.to(torch.uint8)[5:]]
    return ints + [True, False, 1.0, 0.5, None] + tensors


def test_equal_keys_mean_equal_triton_specializations():
    """Two arguments with one key get one specialization from Triton (``native_specialize_impl``), with value and
    alignment specialization on (the most it does), so a kernel cached under a key is the kernel Triton would pick."""
    from triton._C.libtriton import native_specialize_impl
    from triton.backends.compiler import GPUTarget
    from triton.compiler import make_backend

    backend = make_backend(GPUTarget("cuda", 90, 32))
    vals = _values()
    spec = [native_specialize_impl(backend, v, False, True, True) for v in vals]
    for (a, sa), (b, sb) in itertools.combinations(zip(vals, spec), 2):
        if arg_key(a) == arg_key(b):
            assert sa == sb, (a, b, sa, sb)
    # the check above is exercised: arguments that Triton treats alike share keys
    t = torch.zeros(64, dtype=torch.float16)
    assert arg_key(16) == arg_key(48) and arg_key(t) == arg_key(t[8:]) and arg_key(2) == arg_key(17)


def test_serving_launch_keywords_are_hashable():
    """The store's keyword arguments (constexprs from the format tables, some wrapped in ``tl.constexpr``) make a
    key: otherwise every launch would fall back to Triton's own path."""
    from turboquant_core.ops.page_layout import _layout_tables, paged_layout

    lay = paged_layout("turboquant_k3v4_nc", 128, 16)
    kt, vt = _layout_tables(lay, torch.device("cpu"))
    kw = dict(num_warps=4, **kt.constexprs("K", lay.key_is_fp8), **vt.constexprs("V"), **lay.kernel_constexprs(),
              WRAPPED=tl.constexpr(3))
    hash(kwargs_key(kw))
    assert kwargs_key(dict(A=tl.constexpr(3))) == kwargs_key(dict(A=3))


@triton.jit
def _axpy_kernel(X, Y, n, a, BLOCK: tl.constexpr, SHIFT: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = i < n
    tl.store(Y + i, tl.load(X + i, mask=m) * a + SHIFT, mask=m)


def test_launch_matches_the_kernel_call(device):
    x = torch.arange(100, dtype=torch.float32, device=device)
    for n, shift in [(100, 0), (1, 2), (17, 0), (16, 1), (100, 0)]:
        y = torch.zeros(100, device=device)
        launch(_axpy_kernel, (triton.cdiv(n, 32),), x, y, n, 2.0, BLOCK=32, SHIFT=shift)
        ref = torch.zeros(100, device=device)
        ref[:n] = x[:n] * 2 + shift
        assert torch.equal(y, ref)


@pytest.mark.gpu
def test_cached_launches_pick_the_kernel_triton_picks():
    """Repeated launches (served from the cache after the first) and launches whose arguments change what Triton
    specializes on (an unaligned tensor, n == 1, n divisible by 16): each returns the compiled kernel Triton's own
    launch returns for the same arguments, and computes the same result."""
    import turboquant_core.ops.launch as launch_module

    x = torch.arange(200, dtype=torch.float32, device="cuda")
    kept = len(launch_module._compiled)
    for _ in range(2):  # the second launch is served from the cache
        launch(_axpy_kernel, (4,), x, x, 100, 1.0, BLOCK=32, SHIFT=7)  # a key no other test launches
        assert len(launch_module._compiled) == kept + 1
    cases = [(x, 100), (x, 100), (x[1:], 100), (x[1:], 100), (x, 1), (x, 1), (x, 16), (x, 17), (x, 100)]
    for xs, n in cases:
        y = torch.zeros(200, device="cuda")
        got = launch(_axpy_kernel, (triton.cdiv(n, 32),), xs, y, n, 3.0, BLOCK=32, SHIFT=1)
        y_ref = torch.zeros(200, device="cuda")
        want = _axpy_kernel[(triton.cdiv(n, 32),)](xs, y_ref, n, 3.0, BLOCK=32, SHIFT=1)
        assert got is want
        assert torch.equal(y, y_ref)
