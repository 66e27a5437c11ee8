# SPDX-License-Identifier: Apache-2.0
"""Compile the Triton kernel variants that a block of launches reaches in parallel worker processes, before the
launches run.

Why: a serving engine's start-up warm-up (``ops.kernel_warmup``, ``vllm.warmup``) launches every kernel variant once,
and Triton compiles each one in the engine process, one after another: a cold start spends tens of seconds there
while the other CPU cores idle. Compiling needs no GPU, only the variant's specialization and the device's target.

How (``compile_ahead``):
1. record: the launches run once with Triton's ``jit_cache_hook`` answering "handled" for every variant not yet
   compiled in this process, so nothing compiles and nothing launches. The hook receives each variant's
   specialization exactly as Triton's own binder made it from the real arguments (``KernelVariant``).
2. compile: variants not already in Triton's on-disk cache go to worker processes
   (``python -m turboquant_core.ops.compile_ahead``), which rebuild the same source and options and compile them
   with ``triton.compiler.compile`` for the device's target into the same on-disk cache. Each worker also builds the
   variant's host-side launcher: on NVIDIA GPUs Triton compiles one small C extension per kernel signature with the
   system's C compiler when a kernel is first loaded (``CudaLauncher``), one after another in the engine, and caches
   it beside the kernels; it needs libcuda to link against, not a GPU.
3. The caller then runs the launches for real: each variant and its launcher are cache hits, loaded instead of
   compiled.

Nothing here changes what runs: a variant a worker could not compile (or whose cache entry differs) is compiled by
the real launch as before, and its error, if any, is raised there.
"""

from __future__ import annotations

import hashlib
import importlib
import json
import os
import queue
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field

import triton
from triton import knobs
from triton._C.libtriton import get_cache_invalidating_env_vars
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource, make_backend
from triton.compiler.compiler import get_cache_key
from triton.runtime.cache import get_cache_manager


@dataclass(frozen=True)
class KernelVariant:
    """One compiled variant of a ``@triton.jit`` / ``@gluon.jit`` function: where the function lives, Triton's
    serialized specialization of the launch (``triton.runtime.jit.serialize_specialization_data``) and the target
    (backend, arch, warp size) it is compiled for."""

    module: str
    name: str
    specialization: str
    target: tuple[str, int | str, int]

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> KernelVariant:
        d = json.loads(text)
        return cls(d["module"], d["name"], d["specialization"], tuple(d["target"]))


@dataclass
class CompileAheadReport:
    """What ``compile_ahead`` did: variants recorded, already cached, compiled by workers (and failed), the number
    of worker processes and the wall time of each phase."""

    variants: int = 0
    cached: int = 0
    compiled: int = 0
    failed: list[str] = field(default_factory=list)
    launchers: int = 0
    launcher_errors: list[str] = field(default_factory=list)
    workers: int = 0
    record_s: float = 0.0
    compile_s: float = 0.0
    recorded: list[KernelVariant] = field(default_factory=list, repr=False)
    cache_dir: str = ""
    env_vars: dict[str, str] = field(default_factory=dict)
    # recorded variant index -> its cache-key parts as the worker that compiled it computed them (``key_digests``)
    worker_keys: dict[int, dict[str, str]] = field(default_factory=dict, repr=False)
    ptxas: dict[str, str] = field(default_factory=dict)  # the ptxas setting the workers compiled under

    def summary(self) -> dict:
        """The counts, times, cache directory and environment, JSON-ready (without the recorded variants)."""
        return {k: v for k, v in self.__dict__.items() if k not in ("recorded", "worker_keys")}

    def describe(self) -> str:
        text = (f"{self.variants} kernel variants, {self.cached} already cached, {self.compiled} compiled "
                f"({self.launchers} with their launchers) by {self.workers} processes in {self.compile_s:.1f} s")
        if self.failed:
            text += f"; {len(self.failed)} left to the engine ({self.failed[0]})"
        if self.launcher_errors:
            text += f"; {len(self.launcher_errors)} launchers left to the engine ({self.launcher_errors[0]})"
        return text


@contextmanager
def recording_variants():
    """While open, launches of Triton functions do not compile or run: every variant that would compile is added
    to the yielded dict (keyed by function and specialization) instead. Variants already compiled in this process
    launch as usual."""
    found: dict[tuple[str, str, str], KernelVariant] = {}
    previous = knobs.runtime.jit_cache_hook

    def hook(*, key, fn, compile, **_):
        target = fn.jit_function.device_caches[compile["device"]][2]
        found.setdefault((fn.module, fn.name, str(key)), KernelVariant(
            fn.module, fn.name, compile["specialization_data"], (target.backend, target.arch, target.warp_size)))
        return True  # handled: Triton neither compiles nor launches this variant

    knobs.runtime.jit_cache_hook = hook
    try:
        yield found
    finally:
        knobs.runtime.jit_cache_hook = previous


@dataclass
class CompileCount:
    """Variants Triton's compile path loaded from its on-disk cache or compiled, while ``counting_compiles`` was
    open (the names of those compiled; the source and metadata of the first, for ``explain_recompile``)."""

    loaded: int = 0
    compiled: list[str] = field(default_factory=list)
    first_compiled: tuple[object, dict] | None = field(default=None, repr=False)
    # where Triton looked when it compiled the first: its cache directory and cache manager class at that moment
    first_lookup: dict = field(default_factory=dict, repr=False)


@contextmanager
def counting_compiles():
    """While open, counts each variant Triton's compile path loads from its on-disk cache or compiles, through its
    compilation listener (``knobs.compilation.listener``; a listener already set keeps being called)."""
    count = CompileCount()
    previous = knobs.compilation.listener

    def listener(*, src, cache_hit, **kw):
        if cache_hit:
            count.loaded += 1
        else:
            count.compiled.append(getattr(src, "name", str(src)))
            if count.first_compiled is None:
                count.first_compiled = (src, dict(kw.get("metadata") or {}))
                count.first_lookup = {"cache_dir": knobs.cache.dir, "manager": knobs.cache.manager_class}
        if previous is not None:
            previous(src=src, cache_hit=cache_hit, **kw)

    knobs.compilation.listener = listener
    try:
        yield count
    finally:
        knobs.compilation.listener = previous


@contextmanager
def loading_from(report: CompileAheadReport):
    """While open, Triton's cache directory is the one ``compile_ahead`` compiled into (``report.cache_dir``), had
    it changed since (a library that sets TRITON_CACHE_DIR when it first loads a kernel of its own). Yields the
    directory it had before, or None where nothing changed."""
    before = knobs.cache.dir
    if not report.cache_dir or before == report.cache_dir:
        yield None
        return
    with knobs.cache.scope():
        knobs.cache.dir = report.cache_dir
        yield before


def _jit_function(variant: KernelVariant):
    fn = importlib.import_module(variant.module)
    for part in variant.name.split("."):
        fn = getattr(fn, part)
    return fn


def _compile_inputs(variant: KernelVariant):
    """(source, target, options dict) that ``triton.compiler.compile`` receives for this variant when a launch
    compiles it (as ``JITFunction.preload`` rebuilds them from the serialized specialization)."""
    import triton.language as tl

    fn = _jit_function(variant)
    data = json.loads(variant.specialization)
    constexprs = {
        tuple(k): tl.dtype(v) if tl.dtype.is_dtype(v)
        else tl.constexpr(v["constexpr"]) if isinstance(v, dict) and "constexpr" in v else v
        for k, v in zip(data["constant_keys"], data["constant_vals"])
    }
    attrs = {tuple(k): v for k, v in zip(data["attrs_keys"], data["attrs_vals"])}
    signature = {k: _tuples(v) for k, v in data["signature"].items()}
    target = GPUTarget(*variant.target)
    options = make_backend(target).parse_options(
        {k: tuple(v) if isinstance(v, list) else v for k, v in data["options"].items()})
    if fn.is_gluon():
        from triton.experimental.gluon._runtime import GluonASTSource as source_cls
    else:
        source_cls = ASTSource
    return source_cls(fn, signature, constexprs, attrs), target, options.__dict__


def _tuples(v):
    return tuple(_tuples(x) for x in v) if isinstance(v, list) else v


def is_cached(variant: KernelVariant) -> bool:
    """Whether Triton's on-disk cache holds this variant: a launch would load it instead of compiling (the lookup
    of ``triton.compiler.compile``)."""
    src, target, options = _compile_inputs(variant)
    backend = make_backend(target)
    opts = backend.parse_options(dict(options, **src.parse_options()))
    key = get_cache_key(src, backend, opts, env_vars=get_cache_invalidating_env_vars())
    manager = get_cache_manager(hashlib.sha256(key.encode("utf-8")).hexdigest())
    name = f"{src.name[:150]}.json"
    group = manager.get_group(name) or {}
    return not knobs.compilation.always_compile and group.get(name) is not None


def _key_parts(src, target: GPUTarget, options: dict, env_vars: dict) -> dict[str, str]:
    """The parts of Triton's compile-cache key (``get_cache_key``: source, specialization, backend, options,
    cache-invalidating environment variables) for one source, target and options, each as text."""
    backend = make_backend(target)
    opts = backend.parse_options(dict(options, **src.parse_options()))
    parts = {"source": src.fn.cache_key, "attributes": str(src.attrs),
             "signature": str([v for _, v in sorted(src.signature.items())]), "backend": backend.hash()}
    parts.update({f"constant {k}": getattr(v, "cache_key", None) or str(v) for k, v in src.constants.items()})
    parts.update({f"option {k}": str(v) for k, v in opts.__dict__.items()})
    parts.update({f"env {k}": str(v) for k, v in env_vars.items()})
    return parts


def key_digests(src, target: GPUTarget, options: dict, env_vars: dict | None = None) -> dict[str, str]:
    """``_key_parts`` of one source as short digests, with Triton's own installation key and the whole key's hash:
    what a worker process reports for each variant it compiles, so that a process whose key differs can say in which
    part (the source's hash is computed per process, from the function and the globals it reads)."""
    from triton.runtime.cache import triton_key

    env_vars = dict(get_cache_invalidating_env_vars()) if env_vars is None else env_vars
    parts = _key_parts(src, target, options, env_vars)
    parts["triton"] = triton_key()
    backend = make_backend(target)
    opts = backend.parse_options(dict(options, **src.parse_options()))
    parts["hash"] = hashlib.sha256(get_cache_key(src, backend, opts, env_vars=env_vars).encode("utf-8")).hexdigest()
    return {k: hashlib.sha256(str(v).encode("utf-8")).hexdigest()[:12] for k, v in parts.items()}


def explain_recompile(report: CompileAheadReport, src, metadata: dict, lookup: dict | None = None) -> str:
    """Why a launch compiled a kernel that ``compile_ahead`` had recorded (``report``) and compiled or found cached:
    the parts of Triton's cache key in which the launch differs from the recorded variant of that kernel closest to
    it, or, where the keys agree, the cache directories of the two. ``lookup``: ``CompileCount.first_lookup``, where
    Triton looked at the time (else its cache directory now)."""
    name = getattr(src, "name", "")
    candidates = [v for v in report.recorded if v.name.rsplit(".", 1)[-1] == name]
    cache_dir = (lookup or {}).get("cache_dir") or knobs.cache.dir
    if not candidates:
        return f"{name}: not among the {len(report.recorded)} variants recorded ahead"
    target = metadata.get("target")
    if not isinstance(target, GPUTarget):
        target = GPUTarget(*candidates[0].target)
    launched = _key_parts(src, target, metadata, get_cache_invalidating_env_vars())
    best: list[str] | None = None
    match = None
    for v in candidates:
        v_src, v_target, v_options = _compile_inputs(v)
        recorded = _key_parts(v_src, v_target, v_options, report.env_vars)
        diff = [f"{k} {recorded.get(k, '(none)')[:60]} -> {launched.get(k, '(none)')[:60]}"
                for k in sorted(set(recorded) | set(launched)) if recorded.get(k) != launched.get(k)]
        if best is None or len(diff) < len(best):
            best, match = diff, v
    if best:
        return f"{name}: Triton's cache key differs from the variant compiled ahead in " + "; ".join(best[:4])
    # The same key parts when this process computes both: compare with what the worker that compiled the variant
    # computed (the source's part is computed per process).
    theirs = report.worker_keys.get(report.recorded.index(match))
    if theirs:
        here = key_digests(src, target, metadata)
        if metadata.get("hash"):  # the key the launch used
            here["hash"] = hashlib.sha256(str(metadata["hash"]).encode("utf-8")).hexdigest()[:12]
        if theirs.get("hash") != here.get("hash"):
            apart = [f"{k} {theirs[k]} -> {here.get(k)}" for k in sorted(theirs)
                     if k != "hash" and theirs[k] != here.get(k)]
            return (f"{name}: the worker that compiled it computed another cache key ({theirs.get('hash')} -> "
                    f"{here.get('hash')}), apart in " + ("; ".join(apart[:4]) or "no part compared"))
    if cache_dir != report.cache_dir:
        return (f"{name}: same cache key, but Triton's cache directory was {report.cache_dir} ahead and is "
                f"{cache_dir} now")
    manager = (lookup or {}).get("manager")  # a cache manager of its own (TRITON_CACHE_MANAGER) may look elsewhere
    return (f"{name}: same cache key and cache directory ({cache_dir}), yet not found there"
            + (f"; Triton's cache manager: {getattr(manager, '__module__', '')}.{getattr(manager, '__name__', manager)}"
               if manager is not None else ""))


def compile_variant(variant: KernelVariant):
    """Compile one variant into Triton's on-disk cache (a cache hit returns at once)."""
    src, target, options = _compile_inputs(variant)
    return triton.compiler.compile(src, target=target, options=options)


def build_launcher(kernel) -> bool:
    """Build the host-side launcher a compiled kernel's first load on an NVIDIA device builds
    (``CompiledKernel._init_handles``: ``CudaLauncher``, a C extension compiled from the kernel's signature and kept
    in Triton's on-disk cache), or find it there. False for other backends, which have none to build ahead."""
    target = getattr(kernel.metadata, "target", None)
    if target is None or target.backend != "cuda":
        return False
    from triton.backends.nvidia.driver import CudaLauncher

    CudaLauncher(kernel.src, kernel.metadata)
    return True


# A worker holds torch and Triton (about 0.3 GB); a warm-up has a few tens of variants, the slowest taking seconds.
MAX_DEFAULT_WORKERS = 16


def default_workers(ranks_per_node: int = 1) -> int:
    """Worker processes for one engine process: the CPUs it may run on, shared among the ranks of one node, at most
    ``MAX_DEFAULT_WORKERS``."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - not Linux
        cpus = os.cpu_count() or 1
    return max(1, min(MAX_DEFAULT_WORKERS, cpus // max(1, ranks_per_node)))


@dataclass
class WorkerOutcome:
    """What ``compile_in_workers`` got back: one line per variant that failed or was not compiled in time (the engine
    compiles those itself), the number of launchers built, and one line per launcher that could not be built."""

    failed: list[str]
    launchers: int
    launcher_errors: list[str]
    keys: dict[int, dict[str, str]] = field(default_factory=dict)  # variant index -> the worker's key digests
    ptxas: dict[str, str] = field(default_factory=dict)  # the ptxas setting the workers ran with (``workers_ptxas``)


def workers_ptxas(target: GPUTarget) -> dict[str, str]:
    """The ptxas setting (TRITON_PTXAS_PATH or TRITON_PTXAS_BLACKWELL_PATH) under which a worker computes this
    process's cache keys for ``target``.

    Why: the backend part of Triton's key is the ptxas version a process first looked up (``get_ptxas_version`` keeps
    it for the process's life), while a compile runs the ptxas its setting names at the time. Torch inductor sets
    TRITON_PTXAS_PATH to its own ptxas when it first compiles in a process, so an engine that looked up Triton's
    bundled ptxas before keeps keying by it, and a worker started afterwards inherits the variable and keys by the
    other: every variant it compiled is then missed and compiled again. The worker gets whichever of the two
    (the setting now, Triton's own) reports the version in this process's keys; nothing where neither does."""
    if target.backend != "cuda" or not isinstance(target.arch, int) or knobs.nvidia.mock_ptx_version is not None:
        return {}
    from triton.backends.nvidia.compiler import get_ptxas_version

    setting = type(knobs.nvidia).__dict__["ptxas_blackwell" if target.arch >= 100 else "ptxas"]
    keyed = get_ptxas_version(target.arch)
    for path in dict.fromkeys((os.environ.get(setting.key) or setting.default_path, setting.default_path)):
        try:
            if subprocess.check_output([path, "--version"]).decode("utf-8") == keyed:
                return {setting.key: path}
        except (OSError, subprocess.CalledProcessError):
            continue
    return {}


def compile_in_workers(variants: list[KernelVariant], workers: int, timeout_s: float = 300.0) -> WorkerOutcome:
    """Compile ``variants`` and build their launchers in ``workers`` processes (at most one per variant), each taking
    the next variant as it finishes one; workers still running after ``timeout_s`` are stopped."""
    jobs: queue.Queue[int] = queue.Queue()
    for i in range(len(variants)):
        jobs.put(i)
    outcome: dict[int, str | None] = {}  # variant -> None (compiled) or why not
    launchers: dict[int, str | None] = {}  # compiled variant -> None (launcher built) or why not
    keys: dict[int, dict[str, str]] = {}
    lock = threading.Lock()
    env = dict(os.environ)
    env["CUDA_VISIBLE_DEVICES"] = ""  # compiling needs no GPU; a worker must not open a context on one
    env["TRITON_CACHE_DIR"] = knobs.cache.dir  # this process's cache, wherever its setting came from
    # The modules this process imported, from the same places (a function's source is part of its cache key).
    env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)
    ptxas = workers_ptxas(GPUTarget(*variants[0].target)) if variants else {}
    env.update(ptxas)
    deadline = time.monotonic() + timeout_s
    procs = [subprocess.Popen([sys.executable, "-m", __name__], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              stderr=subprocess.DEVNULL, env=env, text=True, bufsize=1)
             for _ in range(max(1, min(workers, len(variants))))]

    def serve(proc: subprocess.Popen) -> None:
        try:
            while time.monotonic() < deadline:
                try:
                    i = jobs.get_nowait()
                except queue.Empty:
                    return
                proc.stdin.write(variants[i].to_json() + "\n")
                proc.stdin.flush()
                line = proc.stdout.readline()
                gone = f"not compiled within {timeout_s:.0f} s" if time.monotonic() >= deadline else "worker exited"
                result = json.loads(line) if line else {"ok": False, "error": gone}
                with lock:
                    outcome[i] = None if result["ok"] else result["error"]
                    if result.get("key"):
                        keys[i] = result["key"]
                    if result.get("launcher") or result.get("launcher_error"):
                        launchers[i] = result.get("launcher_error")
                if not line:
                    return
        except (OSError, ValueError):  # a worker gone or stopped at the deadline: its variant counts as not compiled
            pass
        finally:
            try:
                proc.stdin.close()
            except OSError:
                pass

    threads = [threading.Thread(target=serve, args=(p,), daemon=True) for p in procs]
    for t in threads:
        t.start()
    for t in threads:
        t.join(max(0.0, deadline - time.monotonic()))
    for p in procs:
        try:
            p.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
    with lock:
        failed = [f"{v.name}: {outcome[i]}" if i in outcome else f"{v.name}: not compiled within {timeout_s:.0f} s"
                  for i, v in enumerate(variants) if outcome.get(i, "") is not None]
        return WorkerOutcome(failed, sum(why is None for why in launchers.values()),
                             [f"{variants[i].name}: {why}" for i, why in launchers.items() if why], dict(keys), ptxas)


def _inductor_cache_dir() -> str | None:
    try:
        from torch._inductor.runtime.cache_dir_utils import cache_dir
    except ImportError:
        return None
    return cache_dir()


def kernel_cache_dir() -> str:
    """Where ``compile_ahead`` compiles the variants, and the warm-up loads them from: Triton's cache directory
    (TRITON_CACHE_DIR, else ~/.triton/cache), except where torch inductor has pointed TRITON_CACHE_DIR into its own
    cache, as it does when it first loads a kernel of its own; in that case Triton's default directory, which
    inductor's saves do not touch and later engines find."""
    current = os.path.abspath(knobs.cache.dir)
    inductor = _inductor_cache_dir()
    if inductor and os.path.commonpath([current, os.path.abspath(inductor)]) == os.path.abspath(inductor):
        return knobs.cache.get_triton_dir("cache")
    return knobs.cache.dir


def compile_ahead(launch: Callable[[], object], workers: int) -> CompileAheadReport:
    """Record the kernel variants ``launch()`` would compile (without compiling or running them) and compile those
    not in ``kernel_cache_dir()`` in ``workers`` processes. Call ``launch()`` afterwards, inside
    ``loading_from(report)``, to run it for real. With ``workers`` < 2 only the recording and the cache check happen
    (the launches then compile as before)."""
    with knobs.cache.scope():
        knobs.cache.dir = kernel_cache_dir()
        return _compile_ahead(launch, workers)


def _compile_ahead(launch: Callable[[], object], workers: int) -> CompileAheadReport:
    report = CompileAheadReport()
    t0 = time.perf_counter()
    with recording_variants() as found:
        launch()
    variants = list(found.values())
    todo = [v for v in variants if not is_cached(v)]
    report.variants, report.cached = len(variants), len(variants) - len(todo)
    report.recorded, report.cache_dir = variants, knobs.cache.dir
    report.env_vars = dict(get_cache_invalidating_env_vars())
    report.record_s = time.perf_counter() - t0
    if todo and workers >= 2:
        t0 = time.perf_counter()
        report.workers = min(workers, len(todo))
        done = compile_in_workers(todo, report.workers)
        report.failed, report.launchers, report.launcher_errors = done.failed, done.launchers, done.launcher_errors
        report.worker_keys = {variants.index(todo[i]): k for i, k in done.keys.items()}
        report.ptxas = done.ptxas
        report.compiled = len(todo) - len(report.failed)
        report.compile_s = time.perf_counter() - t0
    return report


def _worker_main() -> None:
    """Compile the variants read from stdin (one JSON ``KernelVariant`` per line), answering one JSON line each on
    the original stdout; anything the compiler prints goes to stderr."""
    results = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    for line in sys.stdin:
        if not line.strip():
            continue
        t0 = time.perf_counter()
        try:
            src, target, options = _compile_inputs(KernelVariant.from_json(line))  # built once: compile, then key
            kernel = triton.compiler.compile(src, target=target, options=options)
            out = {"ok": True, "seconds": time.perf_counter() - t0, "key": key_digests(src, target, options)}
        except Exception as e:  # reported to the parent, whose real launch compiles (and raises) instead
            out = {"ok": False, "error": f"{type(e).__name__}: {str(e)[:500]}"}
        else:
            try:
                out["launcher"] = build_launcher(kernel)
            except Exception as e:  # the kernel's first load builds it instead
                out["launcher"] = False
                out["launcher_error"] = f"{type(e).__name__}: {str(e)[:300]}"
        results.write(json.dumps(out) + "\n")


if __name__ == "__main__":
    _worker_main()


__all__ = ["MAX_DEFAULT_WORKERS", "CompileAheadReport", "CompileCount", "KernelVariant", "WorkerOutcome",
           "build_launcher", "compile_ahead", "compile_in_workers", "compile_variant", "counting_compiles",
           "default_workers", "explain_recompile", "is_cached", "kernel_cache_dir", "loading_from",
           "recording_variants", "workers_ptxas"]
