# SPDX-License-Identifier: Apache-2.0
"""Linear layers over TurboQuant weights (``ops.weight_codec.TQWeight``): the launchers of ``kernels.linear_jit``,
``kernels.linear_mma_jit`` and ``kernels.linear_wgmma_jit``; the plain-torch oracle is
``ops.weight_codec.tq_linear_reference``.

Up to ``MMA_MAX_ROWS`` activation rows (decode batches) on a GPU, the register-tile kernel: the activation is rotated
once per group (one launch), and the product decodes each weight tile straight into tensor-core operand registers.
On sm_90 from ``WGMMA_MIN_ROWS`` rows, the warpgroup kernel instead: the same decode into warpgroup-MMA operand
registers, once for all the batch's rows, the activation shared by four warps through shared memory. Over kernel words
(the served layout) the register-tile kernel (``MMA_INT8``), and the warpgroup kernel up to ``WGMMA_INT8_MAX_ROWS``
rows, multiply in int8: each field's codebook byte (``weight_codec.int8_codebook``, one byte permute per four fields)
against the rotated activation rounded to int8 at a power-of-two step per (row, group), integer MMAs, the groups'
scales applied to the int32 sums (reference ``weight_codec.tq_linear_int8_reference``); otherwise in fp16, the
activation scaled by a power of two per (row, group). On sm_90 the register-tile product is launched as a programmatic
dependent of its rotation (``MMA_PDL``). More rows (prefill, and every product in Triton's interpreter) are
compute-bound: the weight is decoded once into a bf16/fp16 workspace in the rotated domain, the activation rotated
alike, and the GEMM is cuBLAS's. Neither rotates the weight back.
"""

from __future__ import annotations

import functools
import math

import torch
import triton

from ..codebooks import codebook_tensors
from ..formats import get_weight_format
from ..rotation import fwht, hadamard_signs
from .rotation_tables import codec_tables, kernel_coordinate_order
from .weight_codec import TQWeight, int8_codebook, sign_magnitude

MAX_SPLIT_TILES = 4096  # counters per device and stream; more tiles than this never split
DEQUANT_BLOCK_O = 32
MMA_MAX_ROWS = 64  # on GPUs: up to this many rows, the register-tile kernel (linear_mma_jit)
MMA_PROGRAMS_PER_SM = 16  # one warp each: split-K target of the register-tile kernel (about one resident wave:
# fewer, longer programs keep more groups in flight per warp and write fewer partial sums)
MMA_MIN_GROUPS_PER_SPLIT = 2
MMA_BLOCK_O = 32  # output rows per program (one warp) for up to 16 activation rows
WGMMA_MIN_ROWS = 8  # on sm_90: from this many rows up to MMA_MAX_ROWS, the warpgroup kernel (linear_wgmma_jit)
WGMMA_PROGRAMS_PER_SM = 4  # one warpgroup each: split-K target of the warpgroup kernel up to 16 columns
WGMMA_WIDE_PROGRAMS_PER_SM = 2  # from 32 columns, where each group's products take longer than its decode
WGMMA_BLOCK_O = 64  # output rows per program of the warpgroup kernel
MMA_INT8 = True  # the register-tile kernel's product in int8 (kernel words only): codebook bytes, int8 activation
MMA_PDL = True  # on sm_90 and later: the register-tile product a programmatic dependent of the rotation
MMA_SCALES_AHEAD_MIN_BITS = 4  # register-tile kernel: from this width (tq4, not tq3), each group's scales are
# loaded a group ahead, beside the next group's weight; tq3's shorter loop did not gain from it
WGMMA_SCALED_FROM_ROWS = 17  # from this many rows (32 columns), over kernel words, the warpgroup kernel's scaled
# operands (SCALED): no per-group scaling of its products, which add up in the MMA's accumulator; at 16 columns its
# second A operand's registers cost tq4 more than the scaling saves
WGMMA_INT8_MAX_ROWS = 8  # the warpgroup kernel's product in int8 likewise, up to this many rows (past them its
# integer sums' scaling per group costs more than the decode saves)


def wgmma_columns(rows: int) -> int:
    """Activation rows (the MMA's N) per program of the warpgroup kernel: the next power of two from 8, so that the
    variants are those vLLM's CUDA-graph sizes compile."""
    return max(8, 1 << (rows - 1).bit_length())


def mma_tiles(rows: int) -> tuple[int, int]:
    """(output rows, activation rows) per program of the register-tile kernel: up to 32 activation rows per
    program, then more programs."""
    if rows <= 8:
        return MMA_BLOCK_O, 8
    if rows <= 16:
        return MMA_BLOCK_O, 16
    return 32, 32


@functools.lru_cache(maxsize=16)
def _codebook(fmt_name: str, device: str, kernel_words: bool = False) -> torch.Tensor:
    """The format's codebook (float32), indexed by Lloyd-Max index, or as the kernel words' nibble fields index it
    (``weight_codec``): 4-bit ones in sign-magnitude form (``weight_codec.sign_magnitude``), 3-bit ones as they are
    (16 entries, the 8 a field's clear bit 3 reaches repeated)."""
    fmt = get_weight_format(fmt_name)
    cb = codebook_tensors(fmt.bits, fmt.group_size, "cpu")[0].float()
    if kernel_words and fmt.bits == 4:
        cb = cb[sign_magnitude(torch.arange(cb.numel()))]
    elif kernel_words:
        cb = cb.repeat(16 // cb.numel())
    return cb.to(device)


@functools.lru_cache(maxsize=32)
def rotation_operand(fmt_name: str, device: str, dtype: torch.dtype) -> torch.Tensor:
    """M / 16 [128, 128] in ``dtype``: x_g @ M / 16 is the group's rotation R x_g times sqrt(128) / 16, its
    coordinates in kernel order. Entries are +-1/16, exact in fp16 and bf16. Made once per device and type, so
    later calls (CUDA-graph capture included) copy nothing from the host."""
    fmt = get_weight_format(fmt_name)
    gs = fmt.group_size
    order = kernel_coordinate_order(codec_tables(gs, fmt.bits, fmt.seed, "cpu"))
    m = fwht(torch.eye(gs) * hadamard_signs(gs, fmt.seed))[:, order] / 16  # row i: the image of e_i
    return m.to(device=device, dtype=dtype)


@functools.lru_cache(maxsize=16)
def _split_counters(device: str, stream: int) -> torch.Tensor:
    """One zero per tile for the split products' arrivals; every product leaves them zero again. Kept per stream:
    products on two streams at once never share them."""
    return torch.zeros(MAX_SPLIT_TILES, dtype=torch.int32, device=device)


@torch.library.custom_op("turboquant::tq_linear", mutates_args=())
def tq_linear_op(x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor, fmt: str,
                 bias: torch.Tensor | None = None, decode_int8: bool = True) -> torch.Tensor:
    """``tq_linear`` as one opaque op (torch.compile and CUDA graphs see a single call). The split products'
    arrival counters it touches are zero again when it returns: it mutates nothing a caller can see."""
    return tq_linear(x, TQWeight(fmt, packed, scales, x.shape[-1]), bias, decode_int8)


@tq_linear_op.register_fake
def _(x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor, fmt: str,
      bias: torch.Tensor | None = None, decode_int8: bool = True) -> torch.Tensor:
    return x.new_empty(*x.shape[:-1], packed.shape[0])


def _compute_dtype(x: torch.Tensor) -> torch.dtype:
    return x.dtype if x.dtype in (torch.bfloat16, torch.float16) else torch.float16


def tq_linear(x: torch.Tensor, w: TQWeight, bias: torch.Tensor | None = None,
              decode_int8: bool = True) -> torch.Tensor:
    """x [..., in] -> x W_hat^T (+ bias) [..., out] in x's dtype (see the module docstring). ``decode_int8``: the
    decode-sized products may run in int8 (``TQConfig.weights_decode_int8``); off, they keep the activation in fp16."""
    w.check()
    fmt = w.fmt
    if x.shape[-1] != w.in_features:
        raise ValueError(f"{fmt.name}: activation has {x.shape[-1]} features, the weight {w.in_features}")
    lead = x.shape[:-1]
    rows = math.prod(lead)
    x2 = x.reshape(rows, w.in_features).to(_compute_dtype(x))
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    if rows <= MMA_MAX_ROWS and _gluon_runs(str(x2.device)):
        y = _mma_product(x2, w, bias, decode_int8)
    else:
        y = _decoded_product(x2, w, bias)
    return y.to(x.dtype).reshape(*lead, w.out_features)


def rotated_activation(x: torch.Tensor, w: TQWeight) -> torch.Tensor:
    """x [rows, in] (bf16 or fp16) -> [rows, groups * 128] in x's type: each group (zero-padded) times
    ``rotation_operand``, in kernel order (one launch of ``tq_rotate_kernel``)."""
    from ..kernels.linear_jit import tq_rotate_kernel

    fmt = w.fmt
    rows, groups = x.shape[0], fmt.groups(w.in_features)
    xr = torch.empty(rows, groups * fmt.group_size, dtype=x.dtype, device=x.device)
    tq_rotate_kernel[(triton.cdiv(rows, 16), groups)](x, rotation_operand(fmt.name, str(x.device), x.dtype), xr,
                                                     rows, w.in_features, x.stride(0), xr.stride(0), BLOCK_B=16)
    return xr


@functools.lru_cache(maxsize=16)
def mma_rotation_tables(fmt_name: str, device: str, int8: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """(signs fp32 [128], positions int32 [128]) of ``linear_jit.tq_rotate_fp16_kernel``: D's diagonal of the
    format's rotation R = H D / sqrt(128), and the register-tile kernel's K position of each rotated coordinate
    (the inverse of ``ops.paged_decode.decode_key_order``; with ``int8``, of ``int8_key_order``, for
    ``tq_rotate_int8_kernel``). Made once per device."""
    from .paged_decode import decode_key_order

    fmt = get_weight_format(fmt_name)
    gs = fmt.group_size
    pos = torch.empty(gs, dtype=torch.int32)
    pos[int8_key_order(gs) if int8 else decode_key_order(gs)] = torch.arange(gs, dtype=torch.int32)
    return hadamard_signs(gs, fmt.seed).to(device), pos.to(device)


def int8_key_order(dim: int = 128) -> torch.Tensor:
    """Rotated coordinate at each K position of the int8 product's A operand (m16n8k32, four bytes a register):
    field j of group word g = GR*gl + gr (GR = dim/32; coordinate j*G + g, G = dim/8, as ``decode_key_order``) at
    (j & 3) + 4*gl + 16*(j >> 2) + 32*gr."""
    g_count, gr_count = dim // 8, dim // 32
    pos = torch.empty(dim, dtype=torch.long)
    for g in range(g_count):
        gl, gr = divmod(g, gr_count)
        for j in range(8):
            pos[(j & 3) + 4 * gl + 16 * (j >> 2) + 32 * gr] = j * g_count + g
    return pos


@functools.lru_cache(maxsize=16)
def _int8_activation_unit(fmt_name: str) -> float:
    """``tq_rotate_int8_kernel``'s ``unit``: the codebook's half unit (``weight_codec.int8_codebook``) over
    sqrt(group size)."""
    fmt = get_weight_format(fmt_name)
    return int8_codebook(fmt)[1] / 2 / math.sqrt(fmt.group_size)


@functools.lru_cache(maxsize=16)
def _codebook_int8_words(fmt_name: str) -> tuple[int, int]:
    """The int8 product's two byte-permute words (``linear_mma_jit.INT8_LOOKUP4_ASM``): tq4, the byte of each
    magnitude rank 0-7 (its positive entry's, ``weight_codec.int8_codebook``); tq3, the byte of each index."""
    table, _ = int8_codebook(fmt_name)
    if table.numel() == 16:
        table = table[8:]
    b = [int(v) & 0xFF for v in table]
    words = [b[i] | b[i + 1] << 8 | b[i + 2] << 16 | b[i + 3] << 24 for i in (0, 4)]
    return tuple(v - (1 << 32) if v >= 1 << 31 else v for v in words)


@functools.lru_cache(maxsize=16)
def _codebook_int8_tensor(fmt_name: str, device: str) -> torch.Tensor:
    """``_codebook_int8_words`` as int32 [2] on ``device``, made once (CUDA-graph capture copies nothing)."""
    return torch.tensor(_codebook_int8_words(fmt_name), dtype=torch.int32, device=device)


@functools.lru_cache(maxsize=16)
def _codebook_words(fmt_name: str, dtype: torch.dtype = torch.float16) -> tuple[int, ...]:
    """The register-tile kernel's 8 codebook words: a 4-bit codebook (symmetric about zero) as its magnitudes'
    words (``paged_decode.codebook_magnitude_words``), then zeros; a 3-bit one as the byte-permute lookup's words.
    Entries in ``dtype`` (fp16, or bf16 for the warpgroup kernel's scaled operands)."""
    from .paged_decode import codebook_magnitude_words, codebook_permute_words

    cb = _codebook(fmt_name, "cpu").to(dtype)
    return codebook_magnitude_words(cb) + (0, 0, 0, 0) if cb.numel() == 16 else codebook_permute_words(cb)


def _gluon_runs(device: str) -> bool:
    from .paged_decode import _gluon_runs as runs

    return runs(device)


@functools.lru_cache(maxsize=8)
def _pdl_runs(device: str) -> bool:
    """Programmatic dependent launch: CUDA GPUs of sm_90 and later."""
    dev = torch.device(device)
    return dev.type == "cuda" and torch.cuda.get_device_capability(dev) >= (9, 0)


@functools.lru_cache(maxsize=8)
def _wgmma_runs(device: str) -> bool:
    """Where the register-tile kernel runs (``_gluon_runs``) on an sm_90 GPU: wgmma needs sm_90a."""
    dev = torch.device(device)
    return dev.type == "cuda" and _gluon_runs(device) and torch.cuda.get_device_capability(dev) == (9, 0)


def _split_count(tiles: int, groups: int, programs_per_sm: int, device: str) -> int:
    """Group ranges per output tile: enough programs for ``programs_per_sm`` per SM where the tiles are too few,
    at least MMA_MIN_GROUPS_PER_SPLIT groups each; none past MAX_SPLIT_TILES tiles (the arrival counters)."""
    from .paged_attention import _sm_count

    if tiles > MAX_SPLIT_TILES:
        return 1
    splits = max(1, min(triton.cdiv(programs_per_sm * _sm_count(device), tiles), groups // MMA_MIN_GROUPS_PER_SPLIT))
    return triton.cdiv(groups, triton.cdiv(groups, splits))


def _mma_product(x: torch.Tensor, w: TQWeight, bias: torch.Tensor | None, decode_int8: bool = True) -> torch.Tensor:
    from ..kernels.linear_jit import tq_rotate_fp16_kernel, tq_rotate_int8_kernel
    from ..kernels.linear_mma_jit import tq_linear_mma_kernel
    from ..kernels.linear_wgmma_jit import tq_linear_wgmma_kernel
    from .paged_decode import _pdl_launch

    fmt = w.fmt
    rows, dev = x.shape[0], str(x.device)
    groups = fmt.groups(w.in_features)
    wgmma = rows >= WGMMA_MIN_ROWS and _wgmma_runs(dev)
    int8 = decode_int8 and (rows <= WGMMA_INT8_MAX_ROWS if wgmma else bool(MMA_INT8)) and w.kernel_words
    scaled = wgmma and not int8 and w.kernel_words and rows >= WGMMA_SCALED_FROM_ROWS
    pdl = bool(MMA_PDL) and not wgmma and _pdl_runs(dev)
    xq = torch.empty(rows, groups * fmt.group_size, dtype=torch.int8 if int8 else x.dtype if scaled else torch.float16,
                     device=x.device)
    xs = torch.empty(rows, groups, dtype=torch.float32, device=x.device)
    if scaled:
        sx = xs  # not read
        tq_rotate_fp16_kernel[(rows, groups)](x, *mma_rotation_tables(fmt.name, dev), xq, xs, w.in_features,
                                              x.stride(0), xq.stride(0), xs.stride(0), UNSCALED=True, num_warps=1)
    elif int8:
        sx = torch.empty(rows, groups, dtype=torch.int32, device=x.device)
        tq_rotate_int8_kernel[(rows, groups)](x, *mma_rotation_tables(fmt.name, dev, int8=True), xq, xs, sx,
                                              w.in_features, _int8_activation_unit(fmt.name), x.stride(0),
                                              xq.stride(0), xs.stride(0), PDL=pdl, num_warps=1)
    else:
        sx = xs  # not read
        tq_rotate_fp16_kernel[(rows, groups)](x, *mma_rotation_tables(fmt.name, dev), xq, xs, w.in_features,
                                              x.stride(0), xq.stride(0), xs.stride(0), PDL=pdl, num_warps=1)
    if wgmma:
        bn, nq = WGMMA_BLOCK_O, wgmma_columns(rows)
        tiles = triton.cdiv(w.out_features, bn)
        per_sm = WGMMA_PROGRAMS_PER_SM if nq <= 16 else WGMMA_WIDE_PROGRAMS_PER_SM
        splits = _split_count(tiles, groups, per_sm, dev)
    else:
        bn, nq = mma_tiles(rows)
        tiles = triton.cdiv(w.out_features, bn) * triton.cdiv(rows, nq)
        splits = _split_count(tiles, groups, MMA_PROGRAMS_PER_SM, dev)
    per_split = triton.cdiv(groups, splits)
    y = torch.empty(rows, w.out_features, dtype=x.dtype, device=x.device)
    if splits > 1:
        part = torch.empty(splits, rows, w.out_features, dtype=torch.float32, device=x.device)
        counters = _split_counters(dev, torch.cuda.current_stream(x.device).cuda_stream if x.is_cuda else 0)
    else:
        part = counters = y  # not read
    words = (0,) * 8 if int8 else _codebook_words(fmt.name, x.dtype if scaled else torch.float16)
    args = (w.packed, w.scales, bias if bias is not None else y, y, part, counters, rows, w.out_features, groups,
            per_split, xq.stride(0), xs.stride(0), y.stride(0), *words)
    cb = _codebook_int8_tensor(fmt.name, dev) if int8 else xs  # not read without int8
    if wgmma:
        tq_linear_wgmma_kernel[(tiles, splits)](xq, xs, sx, cb, *args, BITS=fmt.bits, NQ=nq,
                                                HAS_BIAS=bias is not None, SPLIT=splits > 1, WORDS=w.kernel_words,
                                                INT8=int8, SCALED=scaled, num_warps=4)
    else:
        tq_linear_mma_kernel[(triton.cdiv(w.out_features, bn), triton.cdiv(rows, nq), splits)](
            xq, xs, sx, cb, *args, BITS=fmt.bits, BN=bn, NQ=nq, HAS_BIAS=bias is not None, SPLIT=splits > 1,
            WORDS=w.kernel_words, INT8=int8, SCALES_AHEAD=fmt.bits >= MMA_SCALES_AHEAD_MIN_BITS,
            num_warps=1, **_pdl_launch(pdl))
    return y


def decoded_weight(w: TQWeight, dtype: torch.dtype) -> torch.Tensor:
    """[out, groups * 128] ``dtype``: sqrt(2) s c[idx] per group, the weight in the rotated domain in kernel order,
    the operand that pairs with ``x_g @ rotation_operand``."""
    from ..kernels.linear_jit import tq_dequant_kernel

    fmt = w.fmt
    groups = fmt.groups(w.in_features)
    out = torch.empty(w.out_features, groups * fmt.group_size, dtype=dtype, device=w.packed.device)
    grid = (triton.cdiv(w.out_features, DEQUANT_BLOCK_O), groups)
    table = _codebook(fmt.name, str(w.packed.device), w.kernel_words)
    tq_dequant_kernel[grid](w.packed, w.scales, table, out, w.out_features, groups, out.stride(0), BITS=fmt.bits,
                            BLOCK_O=DEQUANT_BLOCK_O, WORDS=w.kernel_words)
    return out


def _decoded_product(x: torch.Tensor, w: TQWeight, bias: torch.Tensor | None) -> torch.Tensor:
    xr = rotated_activation(x, w)
    wd = decoded_weight(w, x.dtype)
    if bias is None:
        return xr @ wd.t()
    return torch.addmm(bias.to(x.dtype), xr, wd.t())
