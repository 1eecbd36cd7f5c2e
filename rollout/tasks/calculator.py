"""The calculator task (the default): arithmetic word problems that need a `calculator` tool.

An episode is two real assistant turns in OpenAI chat format:

    user:      "A shop has 37 boxes of 12 pens and 5 loose pens. How many pens are there?"
    assistant: tool_call calculator({"expression": "37*12+5"})
    tool:      "449"
    assistant: "Answer: 449"

Problems are generated from templates with a seeded RNG; the train and eval splits partition
the problem texts by hash (`held_out`), so no eval problem is ever trained on. Every answer is an integer (divisions are exact). `reward` is exact: 1.0 only for
a well-formed calculator call followed by the correct final answer; a malformed call scores 0.
"""

from __future__ import annotations

import ast
import hashlib
import json
import operator
import random
import re
from dataclasses import dataclass
from typing import Any

from rollout.tasks import FunctionTask

SYSTEM_PROMPT = "Use the calculator tool, then give the answer."

CALCULATOR_TOOL: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": "calculator",
        "description": "Evaluate an arithmetic expression.",
        "parameters": {
            "type": "object",
            "properties": {"expression": {"type": "string"}},
            "required": ["expression"],
        },
    },
}
TOOLS = [CALCULATOR_TOOL]

ANSWER_RE = re.compile(r"^\s*Answer:\s*(-?\d+)\s*$")

# (text, expression) templates over integers a, b, c. Each yields an integer answer by
# construction (see `_draw`).
TEMPLATES: list[tuple[str, str]] = [
    ("{name} has {a} apples and buys {b} more. How many apples does {name} have?", "{a}+{b}"),
    ("{name} has {a} coins and spends {b}. How many coins are left?", "{a}-{b}"),
    ("A box holds {a} pens. How many pens are in {b} boxes?", "{a}*{b}"),
    ("{a} cookies are shared equally by {b} kids. How many does each kid get?", "{a}/{b}"),
    ("A shop has {a} boxes of {b} pens and {c} loose pens. How many pens are there?", "{a}*{b}+{c}"),
    ("{name} reads {a} pages a day for {b} days, then {c} more. How many pages in total?", "{a}*{b}+{c}"),
    ("{name} had {a} cards, got {b} more, then gave away {c}. How many cards now?", "{a}+{b}-{c}"),
    ("A bus has {a} rows of {b} seats and {c} are taken. How many seats are free?", "{a}*{b}-{c}"),
    ("{name} buys {a} bags of {b} marbles and splits them into {c} equal piles. How many per pile?",
     "({a}*{b})/{c}"),
    ("{name} earns {a} dollars on each of {b} days and {c} dollars on another day. How much in total?",
     "({a}*{b})+{c}"),
]
NAMES = ["Ann", "Ben", "Cai", "Dev", "Eva", "Fay", "Gus", "Hal", "Ida", "Joe", "Kim", "Lea"]


@dataclass(frozen=True)
class Problem:
    id: str
    question: str
    expression: str  # a correct calculator expression (for demonstrations)
    answer: int

    def messages(self) -> list[dict]:
        return [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": self.question}]


def _draw(rng: random.Random, template: tuple[str, str]) -> tuple[str, str]:
    text, expr = template
    a, b, c = rng.randint(2, 60), rng.randint(2, 30), rng.randint(1, 40)
    if "/" in expr:
        # make every division exact: the dividend is a multiple of the divisor
        if "{c}" in expr:
            c = rng.randint(2, 9)
            a = c * rng.randint(1, 8)
            b = rng.randint(2, 12)
        else:
            b = rng.randint(2, 12)
            a = b * rng.randint(2, 20)
    if expr == "{a}-{b}" and b > a:
        a, b = b, a
    if expr.endswith("-{c}"):
        c = rng.randint(1, a + (a * b if "*" in expr else b))
    fields = dict(a=a, b=b, c=c, name=rng.choice(NAMES))
    return text.format(**fields), expr.format(**fields)


HELD_OUT_BUCKETS = 10  # 1 in 10 problem texts is held out: the eval pool, never a train problem


def held_out(question: str) -> bool:
    """Whether a problem's text is in the eval pool (a hash of the text: the same on every machine)."""
    return int(hashlib.sha256(question.encode()).hexdigest()[:8], 16) % HELD_OUT_BUCKETS == 0


def make_problems(split: str, n: int, seed: int | str = 0) -> list[Problem]:
    """`n` problems of `split` ("train" or "eval"), drawn with `seed`. The splits partition the
    problem texts (`held_out`): no eval problem is ever a train problem, whatever the seeds; each
    seed draws its own sample of its split (the gate draws fresh eval problems each cycle)."""
    if split not in ("train", "eval"):
        raise ValueError(f"split must be 'train' or 'eval', got {split!r}")
    rng = random.Random(f"{split}:{seed}")
    out = []
    while len(out) < n:
        question, expr = _draw(rng, TEMPLATES[rng.randrange(len(TEMPLATES))])
        if held_out(question) == (split == "eval"):
            out.append(Problem(f"{split}-{seed}-{len(out)}", question, expr, int(calculator(expr))))
    return out


_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv}


def _template_regex(text: str) -> re.Pattern:
    pattern = re.escape(text)
    for f in ("a", "b", "c"):
        pattern = pattern.replace(re.escape("{%s}" % f), rf"(?P<{f}>\d+)", 1).replace(re.escape("{%s}" % f), rf"(?P={f})")
    pattern = pattern.replace(re.escape("{name}"), r"(?P<name>[A-Z][a-z]+)", 1).replace(re.escape("{name}"), r"(?P=name)")
    return re.compile(pattern + r"$")


_TEMPLATE_RES = [(_template_regex(text), expr) for text, expr in TEMPLATES]


def problem_from_question(question: str) -> Problem | None:
    """Recover the problem (and so its answer) from its text, or None if no template matches.
    Lets rewards be plain functions of a logged episode, with no side table of answers."""
    for regex, expr in _TEMPLATE_RES:
        m = regex.match(question.strip())
        if m:
            e = expr.format(**m.groupdict())
            return Problem(f"q-{abs(hash(question)) % 10**12}", question.strip(), e, int(float(calculator(e))))
    return None


def calculator(expression: str) -> str:
    """Evaluate + - * / and parentheses over integers; raise ValueError on anything else."""
    if not isinstance(expression, str) or len(expression) > 64:
        raise ValueError("expression must be a string of at most 64 characters")

    def ev(node: ast.AST) -> float:
        if isinstance(node, ast.Expression):
            return ev(node.body)
        if isinstance(node, ast.Constant) and type(node.value) is int:
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            left, right = ev(node.left), ev(node.right)
            if isinstance(node.op, ast.Div) and right == 0:
                raise ValueError("division by zero")
            return _OPS[type(node.op)](left, right)
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
            return -ev(node.operand)
        raise ValueError(f"unsupported expression: {expression!r}")

    try:
        value = ev(ast.parse(expression, mode="eval"))
    except SyntaxError:
        raise ValueError(f"not an arithmetic expression: {expression!r}") from None
    return str(int(value)) if float(value).is_integer() else f"{value:.4g}"


def demonstration(problem: Problem) -> list[dict]:
    """The ideal episode, as OpenAI messages (for SFT)."""
    call = {"id": "call_0", "type": "function",
            "function": {"name": "calculator", "arguments": json.dumps({"expression": problem.expression})}}
    return problem.messages() + [
        {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_0", "content": calculator(problem.expression)},
        {"role": "assistant", "content": f"Answer: {problem.answer}"},
    ]


def parse_calculator_call(tool_calls: list[dict] | None) -> str | None:
    """The expression of a single well-formed calculator call, else None."""
    if not tool_calls or len(tool_calls) != 1:
        return None
    fn = tool_calls[0].get("function") or {}
    if fn.get("name") != "calculator":
        return None
    args = fn.get("arguments")
    try:
        args = json.loads(args) if isinstance(args, str) else args
    except json.JSONDecodeError:
        return None
    if not isinstance(args, dict) or set(args) != {"expression"} or not isinstance(args["expression"], str):
        return None
    return args["expression"]


def reward(problem: Problem, messages: list[dict]) -> float:
    """1.0 iff the episode made one well-formed calculator call and then answered correctly.

    >>> p = make_problems("eval", 1)[0]
    >>> reward(p, demonstration(p))
    1.0
    >>> reward(p, demonstration(p)[:-1] + [{"role": "assistant", "content": "Answer: -1"}])
    0.0
    """
    turns = [m for m in messages if m["role"] == "assistant"]
    if len(turns) != 2 or parse_calculator_call(turns[0].get("tool_calls")) is None:
        return 0.0
    m = ANSWER_RE.match(turns[1].get("content") or "")
    return float(m is not None and not turns[1].get("tool_calls") and int(m.group(1)) == problem.answer)


class _Calculator:
    """The stateless calculator as an environment."""

    def call(self, name: str, arguments: str) -> str:
        if name != "calculator":
            return f"error: no tool named {name!r}"
        try:
            return calculator(json.loads(arguments)["expression"])
        except (ValueError, KeyError, TypeError, json.JSONDecodeError) as e:
            return f"error: {e}"


def partial_credit(messages: list[dict]) -> bool:
    """A well-formed first call (the shaped reward's 0.2, pipelines.rewards.shaped_task_reward)."""
    first = next((m for m in messages if m["role"] == "assistant"), None)
    return first is not None and parse_calculator_call(first.get("tool_calls")) is not None


def env(problem: Problem) -> _Calculator:
    return _Calculator()


TASK = FunctionTask("calculator", TOOLS, max_turns=2, max_tokens=48, feedback_source="env:calculator",
                    problems=make_problems, env=env, reward=reward,
                    demonstration=demonstration, problem_of=problem_from_question, partial_credit=partial_credit)
