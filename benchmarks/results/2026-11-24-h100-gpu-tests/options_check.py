import json
import sys

from vllm import LLM, SamplingParams

llm = LLM(model=sys.argv[1], kv_cache_dtype="turboquant_k3v4_nc", tq_key_centering=False, tq_key_smoothing="off",
          tq_attention_workspace_mb=16, max_model_len=2048, gpu_memory_utilization=0.2, enforce_eager=True,
          kv_cache_memory_bytes=1 << 30, seed=0)
out = llm.generate(["The capital of France is"], SamplingParams(temperature=0, max_tokens=8))
cfg = llm.llm_engine.vllm_config.cache_config.turboquant
print("RESULT", json.dumps({"text": out[0].outputs[0].text, "turboquant": str(cfg)}))
