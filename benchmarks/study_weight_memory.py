"""Live CUDA allocations after vLLM (patched) loads dummy Qwen3-8B weights with --quantization Q, grouped by the Python
frames that made them; the KV cache left out. Usage (repo root): python benchmarks/study_weight_memory.py Q OUT.json"""
import collections
import json
import os
import sys

os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
import torch  # noqa: E402

torch.cuda.memory._record_memory_history(enabled="all", context="all", stacks="python", max_entries=500000)
import vllm.v1.worker.gpu.model_runner as gmr  # noqa: E402

snaps = {}
CLS = next(c for c in vars(gmr).values() if isinstance(c, type) and 'load_model' in vars(c))
orig = CLS.load_model


def load_model(self, *a, **k):
    r = orig(self, *a, **k)
    torch.cuda.synchronize()
    snaps["after_load"] = torch.cuda.memory._snapshot()
    return r


CLS.load_model = load_model
from vllm import LLM  # noqa: E402

q = sys.argv[1]
LLM(model="benchmarks/configs/qwen3-8b", load_format="dummy", skip_tokenizer_init=True,
    quantization=None if q == "none" else q, max_model_len=1024, enforce_eager=True, gpu_memory_utilization=0.6,
    max_num_seqs=8)
snap = snaps.get("after_load") or torch.cuda.memory._snapshot()
groups = collections.Counter()
counts = collections.Counter()
total = 0
for seg in snap["segments"]:
    for b in seg["blocks"]:
        if b["state"] != "active_allocated":
            continue
        frames_all = b.get("frames", [])
        if any("kv_cache" in f["name"] or "kv_cache" in f["filename"] for f in frames_all):
            continue
        total += b["size"]
        frames = [f for f in b.get("frames", []) if f["filename"].endswith(".py")]
        ours = [f for f in frames if "turboquant_core" in f["filename"] or "model_executor" in f["filename"]]
        key = " <- ".join(f"{os.path.basename(f['filename'])}:{f['line']}:{f['name']}" for f in (ours or frames)[:4])
        groups[key] += b["size"]
        counts[key] += 1
out = dict(quantization=q, active_bytes=total, top=[dict(bytes=v, blocks=counts[k], where=k)
                                                    for k, v in groups.most_common(40)])
json.dump(out, open(sys.argv[2], "w"), indent=1)
print(f"{q}: active after load {total / 2**30:.3f} GiB")
for r in out["top"][:25]:
    print(f"  {r['bytes'] / 2**20:9.1f} MiB  {r['blocks']:5d}  {r['where'][:300]}")
