"""Rewards: plain functions of a logged episode, chosen by the config as "module:function".

A reward function takes an `EpisodeRecord` (what the trace store knows about one episode: its
exact tokens, their decoding as OpenAI messages, and the feedback rows joined to it) and returns
a float, or None when it cannot judge the episode. It never sees a side table of answers:
`task_reward` has the episode's task (rollout.tasks) recover the problem from the user message
(`Task.problem_of`) and score the episode by the task's exact reward.

Feedback (user ratings, environment rewards posted to `/v1/feedback`) combines with the
function's value by `FeedbackMode`:
    "ignore"   - the function's value only;
    "override" - the latest feedback reward if the episode has one, else the function's value;
    "mean"     - the mean of the function's value and the latest feedback reward, of those present.
An episode for which the combination is None has a "missing reward" and is not trained on.

Ratings. A feedback row with a `rating` and no `reward` (a thumbs-up/-down, a star rating) counts
as the reward (rating - lo) / (hi - lo) for the dataset's `rating_range` (lo, hi): the default
(-1, 1) maps thumbs-down -1 to 0 and thumbs-up +1 to 1; stars are (1, 5). A rating outside the
range is no reward (the row is ignored, never clamped). A row's explicit reward wins over its rating.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import cached_property, lru_cache
from typing import Literal

from rollout.traces import Feedback

FeedbackMode = Literal["ignore", "override", "mean"]
FEEDBACK_MODES = ("ignore", "override", "mean")
DEFAULT_REWARD_FN = "pipelines.rewards:task_reward"


@dataclass(eq=False)
class EpisodeRecord:
    """One reassembled episode as a reward function sees it.

    `input_ids` (n,) is the last turn's prompt + completion: every token of the episode.
    `text` and `messages` decode it lazily (`decode` is the tokenizer's), so a reward that only
    reads feedback never pays for decoding.
    """

    episode_id: str
    trace_ids: tuple[str, ...]  # one per turn, in turn order
    input_ids: list[int]
    decode: Callable[[list[int]], str] = field(repr=False)
    feedback: tuple[Feedback, ...] = ()  # oldest first
    rating_range: tuple[int, int] = (-1, 1)  # a rating's (lo, hi): it counts as (rating - lo) / (hi - lo)
    chat: object = field(default=None, repr=False)  # rollout.chat.ChatFormat: reads `text` back into messages
    task: object = field(default=None, repr=False)  # rollout.tasks.Task the episode was played on (task_reward's)

    @cached_property
    def text(self) -> str:
        return self.decode(self.input_ids)

    @cached_property
    def messages(self) -> list[dict]:
        """OpenAI messages parsed from `text` (system, user, assistant, tool, ...) by the
        tokenizer's chat format."""
        if self.chat is None:
            raise ValueError("EpisodeRecord.messages needs its chat format (rollout.chat.ChatFormat)")
        return self.chat.messages(self.text)

    @property
    def feedback_reward(self) -> float | None:
        """The latest feedback row's reward, or its rating as a reward (`rating_reward`)."""
        rewards = [r for r in (rating_reward(f, self.rating_range) for f in self.feedback) if r is not None]
        return rewards[-1] if rewards else None


def rating_reward(f: Feedback, rating_range: tuple[int, int] = (-1, 1)) -> float | None:
    """A feedback row's reward: its own, else its rating mapped onto [0, 1], else None.

    >>> from rollout.traces import Feedback
    >>> rating_reward(Feedback(trace_id="t", rating=1)), rating_reward(Feedback(trace_id="t", rating=-1))
    (1.0, 0.0)
    >>> rating_reward(Feedback(trace_id="t", rating=4), (1, 5)), rating_reward(Feedback(trace_id="t", rating=7), (1, 5))
    (0.75, None)
    """
    if f.reward is not None:
        return f.reward
    lo, hi = rating_range
    if f.rating is None or not lo <= f.rating <= hi:
        return None
    return (f.rating - lo) / (hi - lo)


RewardFn = Callable[[EpisodeRecord], "float | None"]


@lru_cache(maxsize=1 << 16)  # GRPO samples each question G times: recover it once (problems are frozen)
def _problem_of(task, question: str):
    return task.problem_of(question)


def episode_problem(ep: EpisodeRecord):
    """The problem of an episode's task, from its first user message (None if it is none of the
    task's)."""
    if ep.task is None:
        raise ValueError("task_reward needs the episode's task (EpisodeRecord.task, the dataset's `task`)")
    user = next((m for m in ep.messages if m["role"] == "user"), None)
    return _problem_of(ep.task, user["content"]) if user else None


def task_reward(ep: EpisodeRecord) -> float | None:
    """The task's exact reward (`Task.reward`: the calculator's is 1.0 iff one well-formed
    calculator call and then the correct answer); None when the question is no task problem."""
    problem = episode_problem(ep)
    if problem is None:
        return None
    return ep.task.reward(problem, ep.messages)


def shaped_task_reward(ep: EpisodeRecord) -> float | None:
    """`task_reward`, with 0.2 of partial credit where the task grants it (`Task.partial_credit`:
    the calculator's, a well-formed calculator call whose answer is wrong): a base model that
    rarely answers right (below ~5% success nearly every GRPO group is all zeros) still gets
    groups with signal, on the format it must learn first."""
    exact = task_reward(ep)
    if exact is None or exact > 0:
        return exact
    credit = getattr(ep.task, "partial_credit", None)
    return 0.2 if credit is not None and credit(ep.messages) else 0.0


def feedback_reward(ep: EpisodeRecord) -> float | None:
    """Feedback only: the latest feedback reward, else None (for traffic with no task)."""
    return ep.feedback_reward


def task_ground_truth(ep: EpisodeRecord) -> str | None:
    """The answer a verl reward function checks against (verl's `reward_model.ground_truth`)."""
    problem = episode_problem(ep)
    return None if problem is None else str(problem.answer)


def load_fn(spec: str) -> Callable:
    """Import "package.module:function" (verl's custom_reward_function style)."""
    module, sep, name = spec.partition(":")
    if not sep or not module or not name:
        raise ValueError(f"expected 'module:function', got {spec!r}")
    fn = getattr(importlib.import_module(module), name, None)
    if not callable(fn):
        raise ValueError(f"{spec!r} is not a callable")
    return fn


def combine(fn_value: float | None, feedback: float | None, mode: FeedbackMode) -> float | None:
    """The episode's reward from the function's value and the latest feedback reward.

    >>> combine(1.0, 0.0, "override"), combine(1.0, None, "override"), combine(1.0, 0.0, "mean")
    (0.0, 1.0, 0.5)
    >>> combine(None, None, "mean") is None
    True
    """
    if mode == "ignore":
        return fn_value
    if mode == "override":
        return feedback if feedback is not None else fn_value
    if mode == "mean":
        present = [v for v in (fn_value, feedback) if v is not None]
        return sum(present) / len(present) if present else None
    raise ValueError(f"feedback mode must be one of {FEEDBACK_MODES}, got {mode!r}")


def score(ep: EpisodeRecord, fn: RewardFn, mode: FeedbackMode) -> float | None:
    """`combine` of `fn(ep)` and the feedback; `fn` is not called when feedback overrides it."""
    fb = ep.feedback_reward
    if mode == "override" and fb is not None:
        return fb
    value = fn(ep)
    if value is not None:
        value = float(value)
    return combine(value, fb, mode)
