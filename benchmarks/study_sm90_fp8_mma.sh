#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# Study: does sm_90 run mma.sync with e4m3 operands natively? Compiles one m16n8k32 e4m3 mma.sync for sm_90 with
# Triton's bundled ptxas and prints its SASS (no GPU needed). Answer (2026-11-26, ptxas of Triton 3.6.0): no, each
# 32-bit operand register is unpacked by F2FP.F16.E4M3.UNPACK_B (two values per instruction) and the product runs
# as two fp16 HMMA.16816; Gluon's mma_v2 on e4m3 operands compiles to the same. The warpgroup MMA with its A
# operand in registers (wgmma m64n8k32 e4m3, B from shared memory, sm_90a) is native: one QGMMA.64x8x32.F32.E4M3.E4M3.
set -euo pipefail
BIN="$(python -c 'import os, triton; print(os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin"))')"
DIR="$(mktemp -d)"
cat > "$DIR/m.ptx" <<'PTX'
.version 8.4
.target sm_90
.address_size 64
.visible .entry k(.param .u64 p)
{
  .reg .b32 a<4>, b<2>;
  .reg .f32 c<4>;
  .reg .b64 rd;
  ld.param.u64 rd, [p];
  ld.global.v4.b32 {a0, a1, a2, a3}, [rd];
  ld.global.v2.b32 {b0, b1}, [rd+16];
  mov.f32 c0, 0f00000000; mov.f32 c1, 0f00000000; mov.f32 c2, 0f00000000; mov.f32 c3, 0f00000000;
  mma.sync.aligned.m16n8k32.row.col.f32.e4m3.e4m3.f32 {c0,c1,c2,c3}, {a0,a1,a2,a3}, {b0,b1}, {c0,c1,c2,c3};
  st.global.v4.f32 [rd+32], {c0,c1,c2,c3};
  ret;
}
PTX
"$BIN/ptxas" -arch=sm_90 "$DIR/m.ptx" -o "$DIR/m.cubin"
"$BIN/cuobjdump" -sass "$DIR/m.cubin" | grep -E "MMA|F2FP"
cat > "$DIR/w.ptx" <<'PTX'
.version 8.4
.target sm_90a
.address_size 64
.visible .entry k(.param .u64 p, .param .u64 desc)
{
  .reg .b32 a<4>;
  .reg .f32 d<4>;
  .reg .b64 rd, db;
  ld.param.u64 rd, [p];
  ld.param.u64 db, [desc];
  ld.global.v4.b32 {a0, a1, a2, a3}, [rd];
  mov.f32 d0, 0f00000000; mov.f32 d1, 0f00000000; mov.f32 d2, 0f00000000; mov.f32 d3, 0f00000000;
  wgmma.fence.sync.aligned;
  wgmma.mma_async.sync.aligned.m64n8k32.f32.e4m3.e4m3 {d0,d1,d2,d3}, {a0,a1,a2,a3}, db, 1, 1, 1;
  wgmma.commit_group.sync.aligned;
  wgmma.wait_group.sync.aligned 0;
  st.global.v4.f32 [rd+32], {d0,d1,d2,d3};
  ret;
}
PTX
"$BIN/ptxas" -arch=sm_90a "$DIR/w.ptx" -o "$DIR/w.cubin"
"$BIN/cuobjdump" -sass "$DIR/w.cubin" | grep -E "GMMA|F2FP"
