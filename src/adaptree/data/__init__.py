"""Benchmark and training prompts.

- :mod:`.prompts`: the :class:`Prompt` type, MT-bench, HumanEval, EAGLE-format question files,
  ``load_dataset(name)``
- :mod:`.sharegpt`: ShareGPT V3 conversations streamed out of the truncated JSON file
- :mod:`.splits`: deterministic, overlap-free train/validation/eval splits
- :mod:`.chat`: multi-turn prompts with the model's own earlier answers (MT-bench protocol)
"""

from adaptree.data.chat import Turn, conversation_turns, turn_messages
from adaptree.data.prompts import (
    DATASETS,
    Prompt,
    humaneval,
    load_dataset,
    load_question_file,
    mt_bench,
)
from adaptree.data.sharegpt import (
    iter_sharegpt,
    sharegpt_conversations,
    sharegpt_path,
    sharegpt_prompts,
)
from adaptree.data.splits import DEFAULT_FRACTIONS, drop_overlap, split_ids, split_of

__all__ = [
    "Prompt", "DATASETS", "load_dataset", "load_question_file", "mt_bench", "humaneval",
    "iter_sharegpt", "sharegpt_conversations", "sharegpt_path", "sharegpt_prompts",
    "DEFAULT_FRACTIONS", "split_ids", "split_of", "drop_overlap",
    "Turn", "conversation_turns", "turn_messages",
]
