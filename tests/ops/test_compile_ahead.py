# SPDX-License-Identifier: Apache-2.0
"""``ops.compile_ahead`` on a machine without a GPU: a warm-up's launches recorded through Triton's own launch path
(a stand-in driver reports an sm_90 device, so the binder specializes the real arguments as on a GPU), compiled by
worker processes into a fresh on-disk cache with their host-side launchers, and then found there by Triton's own
compile path and launcher build for each variant, so that the engine's real launches load instead of compiling.

The launchers are C extensions linked against libcuda: a library named libcuda.so.1 whose driver functions do nothing
(``TRITON_LIBCUDA_PATH``) stands in for the driver's here, so they build and load; none is called."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from turboquant_core.ops.compile_ahead import (
    MAX_DEFAULT_WORKERS,
    KernelVariant,
    compile_ahead,
    compile_in_workers,
    default_workers,
    kernel_cache_dir,
)

ROOT = Path(__file__).resolve().parents[2]

SCRIPT = r'''
import json, os, sys, time
from pathlib import Path

import torch
from triton.runtime.driver import driver

from tests.ops.sm90_probe import Sm90Driver

driver.set_active(Sm90Driver())

from turboquant_core.ops import paged_decode
from triton.backends.nvidia.driver import CudaLauncher
from turboquant_core.ops.compile_ahead import (compile_ahead, counting_compiles, is_cached, recording_variants,
                                               _jit_function)
from turboquant_core.ops.paged import allocate_kv_cache, paged_layout, warmup_kernels

paged_decode._gluon_runs = lambda device: True  # plan as on a GPU: decode takes the register-tile kernels

layout = paged_layout("turboquant_4bit_nc", head_dim=64, block_size=16)
cache = allocate_kv_cache(8, 3, layout)


def warm():
    return warmup_kernels(cache, layout, 9, 3, dtype=torch.bfloat16, paths=("decode",))


def cache_files():
    return sorted(str(p) for p in Path(os.environ["TRITON_CACHE_DIR"]).rglob("*") if p.is_file())


first = compile_ahead(warm, workers=2)
files = cache_files()
with recording_variants() as found:
    warm()
variants = list(found.values())
second = compile_ahead(warm, workers=2)
# Triton's own compile path from each recorded specialization (what a launch runs on a cache miss): a cache hit,
# nothing new written.
t0 = time.perf_counter()
with counting_compiles() as count:
    kernels = [_jit_function(v).preload(v.specialization) for v in variants]
# and the launcher each kernel's first load on a GPU builds (CompiledKernel._init_handles)
for k in kernels:
    CudaLauncher(k.src, k.metadata)
print(json.dumps(dict(
    first=first.summary(), second=second.summary(), names=sorted(v.name for v in variants),
    cached=[is_cached(v) for v in variants], files=len(files), new_files=sorted(set(cache_files()) - set(files)),
    loaded=count.loaded, compiled=count.compiled, preload_s=time.perf_counter() - t0)))
'''


def _stand_in_libcuda(folder: Path) -> Path:
    """A shared library as libcuda.so.1 (and libcuda.so, for the linker) that defines, as functions doing nothing,
    every driver entry point named in Triton's NVIDIA launcher source, built with the system's C compiler as Triton
    builds its launchers."""
    import re

    import triton.backends.nvidia.driver as nvidia_driver

    names = sorted(set(re.findall(r"\bcu[A-Z]\w*", Path(nvidia_driver.__file__).read_text())))
    folder.mkdir()
    src = folder / "stand_in.c"
    src.write_text("".join(f"int {n}(void) {{ return 1; }}\n" for n in names))
    subprocess.run(["cc", "-shared", "-fPIC", "-o", str(folder / "libcuda.so.1"), str(src)], check=True)
    (folder / "libcuda.so").symlink_to("libcuda.so.1")
    return folder


def _run_script(tmp_path: Path, script: str, unset: tuple[str, ...] = (), **extra_env: str) -> dict:
    """``script`` in a fresh interpreter with Triton compiling (not interpreting) into a cache under ``tmp_path``, the
    stand-in libcuda and ``extra_env`` (``unset`` removed): its last line of output, as JSON."""
    libcuda = str(_stand_in_libcuda(tmp_path / "libcuda"))
    env = dict(os.environ, TRITON_INTERPRET="0", PYTHONPATH=str(ROOT), TRITON_CACHE_DIR=str(tmp_path / "cache"),
               TRITON_LIBCUDA_PATH=libcuda,
               LD_LIBRARY_PATH=os.pathsep.join(p for p in (libcuda, os.environ.get("LD_LIBRARY_PATH")) if p),
               **extra_env)
    for name in unset:
        env.pop(name, None)
    p = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=900, cwd=ROOT)
    assert p.returncode == 0, p.stderr[-4000:]
    return json.loads(p.stdout.strip().splitlines()[-1])


@pytest.mark.slow
def test_recorded_warmup_variants_compile_in_workers_and_load_from_the_cache(tmp_path):
    res = _run_script(tmp_path, SCRIPT)
    first, second = res["first"], res["second"]
    # decode at 4 bits, head_dim 64: the store, the query rotation, the register-tile kernel (split and unsplit
    # launches share it) and the merge (unsplit, 4 and 8 splits per load, and the first level of merges of many
    # splits at 4 and 8 per load)
    assert res["names"] == sorted(["tq_paged_store_kernel", "tq_rotate_queries_kernel", "tq_paged_decode_kernel",
                                   "tq_merge_unrotate_kernel", "tq_merge_unrotate_kernel", "tq_merge_unrotate_kernel",
                                   "tq_merge_split_groups_kernel", "tq_merge_split_groups_kernel"])
    assert first["variants"] == 8 and first["cached"] == 0
    assert first["compiled"] == 8 and first["failed"] == [] and first["workers"] == 2
    assert first["launchers"] == 8 and first["launcher_errors"] == []
    assert res["files"] > 0
    assert all(res["cached"])
    # A second start finds every variant cached and starts no worker.
    assert second["variants"] == 8 and second["cached"] == 8 and second["compiled"] == 0 and second["workers"] == 0
    assert res["loaded"] == 8 and res["compiled"] == [], "Triton's own compile path did not find the kernels"
    assert res["new_files"] == [], "Triton's compile path or launcher build did not find what the workers wrote"


# The start of the subprocess scripts below: a 4-bit head_dim-64 cache on the stand-in sm_90 driver; WARM_UP then
# compiles its decode warm-up ahead in two workers (``ahead``).
WARM_UP_HEAD = r'''
import json, os

import torch
from triton.runtime.driver import driver

from tests.ops.sm90_probe import Sm90Driver

driver.set_active(Sm90Driver())

from turboquant_core.ops import paged_decode
from turboquant_core.ops.compile_ahead import (_compile_inputs, _jit_function, compile_ahead, counting_compiles,
                                               explain_recompile, key_digests, loading_from)
from turboquant_core.ops.paged import allocate_kv_cache, paged_layout, warmup_kernels

paged_decode._gluon_runs = lambda device: True
layout = paged_layout("turboquant_4bit_nc", head_dim=64, block_size=16)
cache = allocate_kv_cache(8, 3, layout)
'''
WARM_UP = ("ahead = compile_ahead(lambda: warmup_kernels(cache, layout, 9, 3, dtype=torch.bfloat16, "
           'paths=("decode",)), workers=2)\n')

RECOMPILE_SCRIPT = WARM_UP_HEAD + WARM_UP + r'''
variant = {}
for v in ahead.recorded:  # the first of a kernel's variants (the merge has a split and an unsplit one)
    variant.setdefault(v.name, v)


def launch_again(name):
    with counting_compiles() as count:
        _jit_function(variant[name]).preload(variant[name].specialization)
    return count.compiled, count.first_compiled and explain_recompile(ahead, *count.first_compiled,
                                                                      count.first_lookup)


out = {"ahead": ahead.compiled}
os.environ["TRITON_DISABLE_LINE_INFO"] = "1"  # one of Triton's cache-invalidating variables
out["env"] = launch_again("tq_merge_unrotate_kernel")
del os.environ["TRITON_DISABLE_LINE_INFO"]
out["dir_ahead"], out["dir_now"] = ahead.cache_dir, os.environ["OTHER_CACHE_DIR"]
os.environ["TRITON_CACHE_DIR"] = os.environ["OTHER_CACHE_DIR"]
out["dir"] = launch_again("tq_rotate_queries_kernel")
with loading_from(ahead) as moved:  # the directory compiled into, for the duration
    out["pinned"] = [moved, launch_again("tq_paged_store_kernel")]
    # an entry gone from the directory compiled into: the same key and directory, where Triton looked at the time
    import shutil
    from triton.runtime.cache import get_cache_manager
    from turboquant_core.ops.compile_ahead import compile_variant
    shutil.rmtree(get_cache_manager(compile_variant(variant["tq_paged_store_kernel"]).hash).cache_dir)
    out["gone"] = launch_again("tq_paged_store_kernel")
    # each worker reported the key this process computes for its variant
    from turboquant_core.ops.compile_ahead import _compile_inputs, key_digests
    out["worker_keys"] = [ahead.worker_keys.get(i) == key_digests(*_compile_inputs(v))
                          for i, v in enumerate(ahead.recorded)]
    # a worker that had computed another key (its source's part, as a global read differently there would make it)
    i = [v.name for v in ahead.recorded].index(variant["tq_merge_unrotate_kernel"].name)
    ahead.worker_keys[i] = dict(ahead.worker_keys[i], source="0" * 12, hash="f" * 12)
    shutil.rmtree(get_cache_manager(compile_variant(variant["tq_merge_unrotate_kernel"]).hash).cache_dir)
    out["worker"] = [ahead.worker_keys[i], key_digests(*_compile_inputs(variant["tq_merge_unrotate_kernel"])),
                     launch_again("tq_merge_unrotate_kernel")]
print(json.dumps(out))
'''


@pytest.mark.slow
def test_a_variant_compiled_again_is_explained_by_its_key_or_cache_directory(tmp_path):
    """A launch that compiles what the workers compiled says why: the part of Triton's cache key that changed (here a
    cache-invalidating environment variable), or, with the same key, the cache directory that changed; inside
    ``loading_from`` it loads from the directory compiled into."""
    res = _run_script(tmp_path, RECOMPILE_SCRIPT, unset=("TRITON_DISABLE_LINE_INFO",),
                      OTHER_CACHE_DIR=str(tmp_path / "other"))
    assert res["ahead"] == 8
    compiled, why = res["env"]
    assert compiled == ["tq_merge_unrotate_kernel"]
    assert why == ("tq_merge_unrotate_kernel: Triton's cache key differs from the variant compiled ahead in "
                   "env TRITON_DISABLE_LINE_INFO (none) -> true"), why
    compiled, why = res["dir"]
    assert compiled == ["tq_rotate_queries_kernel"]
    assert why == (f"tq_rotate_queries_kernel: same cache key, but Triton's cache directory was {res['dir_ahead']} "
                   f"ahead and is {res['dir_now']} now"), why
    # loading_from: the directory compiled into while open: a load, not a compile
    assert res["pinned"] == [res["dir_now"], [[], None]]
    compiled, why = res["gone"]
    assert compiled == ["tq_paged_store_kernel"]
    assert why == (f"tq_paged_store_kernel: same cache key and cache directory ({res['dir_ahead']}), yet not found "
                   "there"), why
    # the workers' keys are this process's, part by part; one that was not is named with the part it differs in
    assert res["worker_keys"] == [True] * 8, res["worker_keys"]
    theirs, here, (compiled, why) = res["worker"]
    assert compiled == ["tq_merge_unrotate_kernel"]
    assert why == ("tq_merge_unrotate_kernel: the worker that compiled it computed another cache key "
                   f"(ffffffffffff -> {here['hash']}), apart in source 000000000000 -> {here['source']}"), why


STALE_PTXAS_SCRIPT = WARM_UP_HEAD + r'''
from triton.backends.nvidia.compiler import get_ptxas_version

keyed = get_ptxas_version(90)  # this process's keys now carry Triton's bundled ptxas
os.environ["TRITON_PTXAS_PATH"] = os.environ["OTHER_PTXAS"]  # as torch inductor sets it on its first compile
''' + WARM_UP + r'''
with counting_compiles() as count:
    for v in ahead.recorded:
        _jit_function(v).preload(v.specialization)
print(json.dumps({"compiled_ahead": ahead.compiled, "ptxas": ahead.ptxas,
                  "keyed_unchanged": get_ptxas_version(90) == keyed,
                  "worker_keys": [ahead.worker_keys.get(i) == key_digests(*_compile_inputs(v))
                                  for i, v in enumerate(ahead.recorded)],
                  "loaded": count.loaded, "compiled": count.compiled}))
'''


@pytest.mark.slow
def test_workers_key_by_the_ptxas_this_process_keys_by(tmp_path):
    """An engine process keys its variants by the ptxas it first looked up (Triton's bundled one); torch inductor
    then points TRITON_PTXAS_PATH at another ptxas. The workers, which inherit that variable, still compute this
    process's keys, so each variant they compiled is loaded, not compiled again."""
    import shutil

    import triton

    bundled = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas"
    others = [p for p in (shutil.which("ptxas"), "/usr/local/cuda/bin/ptxas") if p and Path(p).is_file()]
    version = lambda p: subprocess.run([str(p), "--version"], capture_output=True, text=True).stdout  # noqa: E731
    other = next((p for p in others if version(p) != version(bundled)), None)
    if other is None:
        pytest.skip("no ptxas of another version than Triton's own on this machine")
    res = _run_script(tmp_path, STALE_PTXAS_SCRIPT, unset=("TRITON_PTXAS_PATH",), OTHER_PTXAS=other)
    assert res["compiled_ahead"] == 8 and res["keyed_unchanged"]
    assert res["ptxas"] == {"TRITON_PTXAS_PATH": str(bundled)}
    assert res["worker_keys"] == [True] * 8, res["worker_keys"]
    assert res["loaded"] == 8 and res["compiled"] == [], res["compiled"]


def test_variants_compile_outside_the_directory_torch_inductor_points_triton_to(tmp_path, monkeypatch):
    """Inductor points TRITON_CACHE_DIR into its own cache, which its saves replace: the variants go to Triton's
    default directory then, and to TRITON_CACHE_DIR wherever else it points."""
    from triton import knobs

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor_cache"))
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "inductor_cache" / "triton" / "0"))
    assert kernel_cache_dir() == knobs.cache.get_triton_dir("cache") != knobs.cache.dir
    report = compile_ahead(lambda: None, workers=0)
    assert report.cache_dir == knobs.cache.get_triton_dir("cache")
    assert knobs.cache.dir == str(tmp_path / "inductor_cache" / "triton" / "0")  # left as it was
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "inductor_cache_of_another_kind"))
    assert kernel_cache_dir() == str(tmp_path / "inductor_cache_of_another_kind")
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "mine"))
    assert kernel_cache_dir() == compile_ahead(lambda: None, workers=0).cache_dir == str(tmp_path / "mine")


def test_a_variant_that_cannot_compile_is_reported_not_raised():
    bad = KernelVariant("turboquant_core.kernels.paged_decode_jit", "no_such_kernel", "{}", ("cuda", 90, 32))
    done = compile_in_workers([bad], workers=2)
    assert len(done.failed) == 1 and done.failed[0].startswith("no_such_kernel: AttributeError")
    assert done.launchers == 0 and done.launcher_errors == []


def test_workers_past_the_deadline_are_stopped_and_their_variants_left_to_the_engine():
    import time

    bad = KernelVariant("turboquant_core.kernels.paged_decode_jit", "no_such_kernel", "{}", ("cuda", 90, 32))
    t0 = time.monotonic()
    done = compile_in_workers([bad, bad], workers=1, timeout_s=0.05)  # before the worker has imported anything
    assert done.failed == ["no_such_kernel: not compiled within 0 s"] * 2
    assert time.monotonic() - t0 < 5.0


def test_variant_json_round_trip_and_worker_count():
    v = KernelVariant("m", "f", json.dumps({"name": "m.f"}), ("cuda", 90, 32))
    assert KernelVariant.from_json(v.to_json()) == v
    assert MAX_DEFAULT_WORKERS >= default_workers(1) >= default_workers(2) >= 1
    assert default_workers(10_000) == 1
