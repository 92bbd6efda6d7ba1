"""Multi-turn prompts, MT-bench protocol: every turn after the first sees the model's own earlier answers.

For a :class:`~adaptree.data.prompts.Prompt` with user turns ``[q1, q2]`` and a model ``answer_fn``:

- turn 1 sends ``[user q1]`` and gets ``a1``;
- turn 2 sends ``[user q1, assistant a1, user q2]`` and gets ``a2``;

as FastChat's ``gen_model_answer`` does (an answer goes into the history stripped of surrounding
whitespace; ``strip=False`` keeps it verbatim). A ``system`` message, when given, comes first in every
turn. ``answer_fn`` may return anything (e.g. the engine's full generation result with its timing and
acceptance numbers); ``to_text`` extracts the answer text from it (default: the result itself, which must
then be a ``str``). Each turn is returned as a :class:`Turn`, so a benchmark keeps per-turn results.
Pass ``max_turns=1`` for first turns only.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Generic, Sequence, TypeVar

from adaptree.data.prompts import Prompt

__all__ = ["Turn", "turn_messages", "conversation_turns"]

R = TypeVar("R")

Message = dict[str, str]


@dataclass
class Turn(Generic[R]):
    index: int
    """0-based turn number."""
    messages: list[Message]
    """What was sent to the model: the history so far, ending with this turn's user message."""
    result: R
    """What ``answer_fn`` returned."""
    text: str
    """The answer text as it enters the next turn's history."""


def turn_messages(user_turns: Sequence[str], answers: Sequence[str], system: str | None = None) -> list[Message]:
    """Messages for turn ``len(answers)``: user turns interleaved with the earlier answers, ending with the
    next user turn. ``answers`` must be shorter than ``user_turns``."""
    if len(answers) >= len(user_turns):
        raise ValueError(f"{len(answers)} answers for {len(user_turns)} user turns: nothing left to ask")
    messages: list[Message] = [{"role": "system", "content": system}] if system else []
    for question, answer in zip(user_turns, answers):
        messages.append({"role": "user", "content": question})
        messages.append({"role": "assistant", "content": answer})
    messages.append({"role": "user", "content": user_turns[len(answers)]})
    return messages


def _as_text(result: Any) -> str:
    if not isinstance(result, str):
        raise TypeError(f"answer_fn returned {type(result).__name__}, not str; pass to_text= to extract the text")
    return result


def conversation_turns(prompt: Prompt | Sequence[str], answer_fn: Callable[[list[Message]], R], *,
                       max_turns: int | None = None, system: str | None = None,
                       to_text: Callable[[R], str] | None = None, strip: bool = True) -> list[Turn[R]]:
    """Run ``prompt``'s user turns in order through ``answer_fn(messages)``, each turn seeing the earlier
    answers (MT-bench protocol, see the module docstring)."""
    user_turns = list(prompt.turns if isinstance(prompt, Prompt) else prompt)
    if isinstance(prompt, str) or not all(isinstance(t, str) for t in user_turns):
        raise TypeError("prompt must be a Prompt or a sequence of user-turn strings")
    if not user_turns:
        raise ValueError("the prompt has no turns")
    if max_turns is not None:
        if max_turns < 1:
            raise ValueError(f"max_turns must be >= 1, got {max_turns}")
        user_turns = user_turns[:max_turns]
    extract = to_text or _as_text
    answers: list[str] = []
    turns: list[Turn[R]] = []
    for i in range(len(user_turns)):
        messages = turn_messages(user_turns, answers, system)
        result = answer_fn([dict(m) for m in messages])  # a copy: answer_fn may not alter our history
        text = extract(result)
        if strip:
            text = text.strip()
        answers.append(text)
        turns.append(Turn(i, messages, result, text))
    return turns
