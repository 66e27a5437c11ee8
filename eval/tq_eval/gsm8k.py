# SPDX-License-Identifier: Apache-2.0
"""GSM8K through lm-eval (0.4.13): lm-eval's own ``gsm8k`` task, from the hub or from local files.

The task config is lm-eval's ``tasks/gsm8k/gsm8k.yaml`` itself (prompt "Question: ...\\nAnswer:",
5-shot from the train split, greedy, the "strict-match" and "flexible-extract" filters), loaded
with lm-eval's YAML loader, so scores are "as lm-eval reports them". Offline, only the dataset
source changes: ``dataset_path: json`` with ``data_files`` pointing at ``train.jsonl`` and
``test.jsonl`` of the original release (openai/grade-school-math), which hold the same records
as the hub dataset ``openai/gsm8k`` (config ``main``).

The task goes to ``TaskManager(include_defaults=False)`` as an inline dict: indexing lm-eval's
~15k built-in task files is skipped (seconds to tens of seconds per engine).
"""

from __future__ import annotations

from pathlib import Path

HUB = "hub"
TASK_NAME = "gsm8k"
METRICS = {"strict": "exact_match,strict-match", "flexible": "exact_match,flexible-extract"}


def task_config(data: str) -> dict:
    """lm-eval task dict for GSM8K. data: "hub" (dataset openai/gsm8k) or a directory holding
    train.jsonl and test.jsonl."""
    import lm_eval
    from lm_eval.tasks._yaml_loader import load_yaml

    yaml_path = Path(lm_eval.__file__).parent / "tasks" / "gsm8k" / "gsm8k.yaml"
    cfg = dict(load_yaml(yaml_path, resolve_func=True))
    cfg.pop("tag", None)
    cfg["task"] = TASK_NAME
    if data != HUB:
        d = Path(data).resolve()
        files = {"train": d / "train.jsonl", "test": d / "test.jsonl"}
        missing = [str(p) for p in files.values() if not p.is_file()]
        if missing:
            raise FileNotFoundError(f"GSM8K data directory lacks {', '.join(missing)} (or pass '{HUB}')")
        cfg["dataset_path"] = "json"
        cfg["dataset_name"] = None
        cfg["dataset_kwargs"] = {"data_files": {k: str(v) for k, v in files.items()}}
    return cfg


def extract_scores(results: dict, task: str = TASK_NAME) -> dict:
    """Strict and flexible exact match (and their standard errors) from ``simple_evaluate``'s
    return value. A standard error lm-eval could not compute (e.g. one sample) becomes None."""
    try:
        r = results["results"][task]
    except (KeyError, TypeError):
        raise ValueError(f"lm-eval results hold no task {task!r}") from None

    def num(key: str) -> float | None:
        v = r.get(key)
        try:
            return float(v)
        except (TypeError, ValueError):
            return None

    out: dict = {}
    for name, key in METRICS.items():
        if key not in r:
            raise ValueError(f"lm-eval results for {task!r} lack {key!r}; have {sorted(r)}")
        metric, flt = key.split(",", 1)
        out[name] = num(key)
        out[f"{name}_stderr"] = num(f"{metric}_stderr,{flt}")
    n = (results.get("n-samples") or {}).get(task, {})
    out["n"] = int(n.get("effective", r.get("sample_len", 0)) or 0)
    return out


def evaluate(lm, data: str, limit: int | None, num_fewshot: int = 5, seed: int = 1234) -> dict:
    """Run GSM8K on an lm-eval LM object; returns ``extract_scores`` plus the settings used."""
    import lm_eval
    from lm_eval.tasks import TaskManager

    results = lm_eval.simple_evaluate(
        model=lm,
        tasks=[task_config(data)],
        num_fewshot=num_fewshot,
        limit=limit,
        task_manager=TaskManager(include_defaults=False),
        log_samples=False,
        bootstrap_iters=1000,
        random_seed=seed,
        numpy_random_seed=seed,
        torch_random_seed=seed,
        fewshot_random_seed=seed,
    )
    if results is None:  # non-zero ranks return None; there is one rank here
        raise RuntimeError("lm-eval returned no results")
    scores = extract_scores(results)
    scores.update(num_fewshot=num_fewshot, limit=limit, data=data, lm_eval_version=_lm_eval_version())
    return scores


def _lm_eval_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("lm_eval")
    except PackageNotFoundError:
        return "unknown"
