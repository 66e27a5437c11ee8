# SPDX-License-Identifier: Apache-2.0
"""The CPU results next to the vLLM H100 run with key centering on the same prompts (table as in
``../2026-11-23-cpu-niah-key-variants/compare_vllm.py``, which does the work).

Usage: python compare_vllm.py niah-2048-served-sink.json
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[2]
_spec = importlib.util.spec_from_file_location("compare_base", HERE.parent / "2026-11-23-cpu-niah-key-variants" /
                                               "compare_vllm.py")
compare_base = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(compare_base)

VLLM_RUN = ROOT / "eval/results/smollm2-135m-instruct/2026-11-23-h100-key-centering/configs"
VLLM_MATCH = {  # CPU variant -> vLLM config of the same encoding (key centering on: the patched default)
    "full precision": "patched__auto.json",
    "k3v4 served": "patched__turboquant_k3v4_nc.json",
    "4bit served": "patched__turboquant_4bit_nc.json",
}

if __name__ == "__main__":
    compare_base.compare(sys.argv[1:], VLLM_RUN, VLLM_MATCH)
