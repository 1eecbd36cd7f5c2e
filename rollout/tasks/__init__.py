"""Built-in tasks: what the loop's own collector plays, scores, evaluates and bootstraps from.

    task = load_task("calculator")        # or "sql", or "my_pkg.tasks:TASK" (any object of this shape)
    problems = task.problems("train", 64, seed=1)
    env = task.env(problems[0])           # one episode's environment: the state its tools act on
    env.call("calculator", '{"expression": "2+3"}')   # -> "5" (a tool's result is text)
    task.reward(problem, messages)        # exact, in [0, 1]
    task.demonstration(problem)           # the ideal episode as OpenAI messages (the bootstrap's SFT)
    task.problem_of(question)             # a logged episode's problem, from its user message

Nothing in loop/, pipelines/ or trainers/ knows a task by name: they take one of these objects
(`task.name` in the config picks it). A task owns its problems (train and eval splits that never
share a question), its tools and their environment, its exact reward and its demonstrations.
Rewards stay plain functions of a logged episode: `problem_of` recovers the problem (and so its
answer) from the question's text, so the dataset build needs no side table.

Your own agent on your own tasks is the other plugin (`task.agent`, rollout/agents.py): it speaks
chat completions; a Task here plays token-in/token-out through the loop's collector.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol


class Problem(Protocol):
    id: str
    question: str

    def messages(self) -> list[dict]: ...


class Env(Protocol):
    def call(self, name: str, arguments: str) -> str:
        """Run tool `name` on its JSON `arguments`; a tool's error is a result ("error: ..."), never raised."""


class Task(Protocol):
    name: str
    tools: list[dict]  # OpenAI tool schemas, rendered into every prompt
    max_turns: int  # assistant turns an episode may take
    max_tokens: int  # tokens an assistant turn may sample
    feedback_source: str  # the `source` of the rewards the collector posts

    def problems(self, split: str, n: int, seed: int | str = 0) -> list[Problem]: ...

    def env(self, problem: Problem) -> Env: ...

    def reward(self, problem: Problem, messages: list[dict]) -> float: ...

    def demonstration(self, problem: Problem) -> list[dict]: ...

    def problem_of(self, question: str) -> Problem | None: ...


@dataclass(frozen=True, eq=False)  # hashed by identity: rewards cache problems per task
class FunctionTask:
    """A `Task` made of a module's functions (the built-in tasks are; yours may be)."""

    name: str
    tools: list[dict]
    max_turns: int
    max_tokens: int
    feedback_source: str
    problems: Callable[..., list]  # (split, n, seed=0)
    env: Callable  # (problem) -> Env
    reward: Callable[[Any, list[dict]], float]
    demonstration: Callable[[Any], list[dict]]
    problem_of: Callable[[str], Any]
    partial_credit: Callable[[list[dict]], bool] | None = None  # pipelines.rewards.shaped_task_reward's 0.2
    version: int | None = None  # bumped when problems or demonstrations change (the bootstrap's cache key)


BUILT_IN = {"calculator": "rollout.tasks.calculator:TASK", "sql": "rollout.tasks.sql:TASK"}


def load_task(name: str) -> Task:
    """A built-in task by name, or "package.module:attribute" naming any object shaped as `Task`."""
    spec = BUILT_IN.get(name, name)
    module, sep, attr = spec.partition(":")
    if not sep or not module or not attr:
        raise ValueError(f"task {name!r}: a built-in task ({', '.join(BUILT_IN)}) or 'module:attribute'")
    try:
        task = getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError) as e:
        raise ValueError(f"task {name!r}: cannot import {spec} ({e})") from None
    missing = [a for a in ("name", "tools", "max_turns", "max_tokens", "feedback_source", "problems", "env", "reward",
                           "demonstration", "problem_of") if not hasattr(task, a)]
    if missing:
        raise ValueError(f"task {name!r}: {spec} lacks {', '.join(missing)} (see rollout.tasks.Task)")
    return task


def parse_arguments(arguments: Any) -> dict | None:
    """A tool call's arguments as a dict (they arrive as a JSON string), or None if they are not one."""
    import json

    try:
        args = json.loads(arguments) if isinstance(arguments, str) else arguments
    except json.JSONDecodeError:
        return None
    return args if isinstance(args, dict) else None
