# SPDX-License-Identifier: Apache-2.0
"""NIAH through transformers (fp32, CPU, full-precision cache) on the prompts of the vLLM suite.

Same generator, renderer, tokenizer and scorer as `eval/` (`tq_eval.niah`, `tq_eval.worker.niah_renderer`); greedy,
16 new tokens. Sample i of a (length, depth) is the same prompt as sample i of a vLLM run with seed 0, so the
per-prompt outcomes can be set side by side with a vLLM run's `raw/<config>/result.json` (`--compare`).
"""

import argparse
import json
import sys
import time
from pathlib import Path

import torch
from tqdm import tqdm
from transformers import AutoModelForCausalLM, AutoTokenizer

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "eval"))
from tq_eval import niah as niah_mod  # noqa: E402
from tq_eval.worker import niah_renderer  # noqa: E402

p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
p.add_argument("model", help="Hugging Face model folder (e.g. from `tq convert-gguf`)")
p.add_argument("--length", type=int, default=2048)
p.add_argument("--samples", type=int, default=4, help="prompts per depth")
p.add_argument("--depths", default="0,25,50,75,100")
p.add_argument("--threads", type=int, default=2)
p.add_argument("--json", required=True, help="output records")
p.add_argument("--compare", nargs="*", default=[], help="vLLM result.json files to compare per prompt")
a = p.parse_args()
torch.set_num_threads(a.threads)
tok = AutoTokenizer.from_pretrained(a.model)
model = AutoModelForCausalLM.from_pretrained(a.model, dtype=torch.float32, attn_implementation="eager").eval()
render, encode, _ = niah_renderer(tok)
depths = [float(x) for x in a.depths.split(",")]
grid = niah_mod.make_grid(lambda t: len(encode(t)), [a.length], depths, a.samples, seed=0, render=render,
                          target_tokens={a.length: a.length})
records, t0 = [], time.time()
for s in tqdm(grid, desc=f"NIAH {a.length}"):
    ids = torch.tensor([encode(s.prompt)])
    with torch.inference_mode():
        out = model.generate(ids, max_new_tokens=16, do_sample=False)
    answer = tok.decode(out[0, ids.shape[1]:], skip_special_tokens=True)
    records.append({**s.to_dict(), "answer": answer[:80], "correct": niah_mod.score_answer(answer, s.needle)})
result = {"model": Path(a.model).name, "length": a.length, "samples_per_depth": a.samples, "depths": depths,
          "correct": sum(r["correct"] for r in records), "prompts": len(records), "wall_s": round(time.time() - t0),
          "torch": torch.__version__, "records": records, "compare": {}}
key = lambda r: (r["length"], r["depth_percent"], r["sample"])  # noqa: E731
mine = {key(r): r["correct"] for r in records}
for path in a.compare:
    other = json.loads(Path(path).read_text())
    theirs = {key(r): r["correct"] for r in other["tasks"]["niah"]["records"] if key(r) in mine}
    result["compare"][other["config"]["id"]] = {
        "correct": sum(theirs.values()), "prompts": len(theirs),
        "same_outcome": sum(mine[k] == v for k, v in theirs.items())}
Path(a.json).write_text(json.dumps(result, indent=1))
print(json.dumps({k: v for k, v in result.items() if k != "records"}, indent=1))
