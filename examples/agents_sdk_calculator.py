"""The calculator agent written with the OpenAI Agents SDK (`pip install openai-agents`), as a
Flywheel agent plugin: `task.agent: examples/agents_sdk_calculator.py:play`.

    ./fw loop run conf/agent_rl.yaml task.agent=examples/agents_sdk_calculator.py:play task.source=TASKS

Why this framework: it runs against any OpenAI-compatible endpoint with the client it is handed
(`OpenAIChatCompletionsModel(openai_client=...)`), with function tools and the tool loop built in,
and with its tracing exporter off it makes no request but to that endpoint (LangGraph's
`langchain-openai` pulls `tiktoken`, whose encodings download from the internet on first use).

The agent code is what an Agents SDK user writes; the one Flywheel-specific thing is that it takes
the client it is given (its requests carry the episode id, so every turn of the episode is traced
under it). The framework re-sends the conversation as text each turn, so the server re-renders
and re-tokenizes it: turn k+1's prompt need not extend turn k's sampled tokens exactly (the
dataset build splits such an episode into segments of turns that do, so only sampled tokens are
trained, and counts them; the collector of a built-in task sends token ids and never re-tokenizes).
"""

from __future__ import annotations

import json

from agents import Agent, FunctionTool, ModelSettings, OpenAIChatCompletionsModel, RunConfig, Runner

SYSTEM = "Use the calculator tool, then give the answer."  # the instructions the base model was trained on
CALCULATOR = {"name": "calculator", "description": "Evaluate an arithmetic expression.",
              "parameters": {"type": "object", "properties": {"expression": {"type": "string"}},
                             "required": ["expression"]}}


def evaluate(expression: str) -> str:
    """+ - * / and parentheses on integers, nothing else (no eval of arbitrary code)."""
    import ast
    import operator

    ops = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv}

    def walk(node):
        if isinstance(node, ast.BinOp) and type(node.op) in ops:
            return ops[type(node.op)](walk(node.left), walk(node.right))
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
            return -walk(node.operand)
        if isinstance(node, ast.Constant) and isinstance(node.value, int):
            return node.value
        raise ValueError(f"not arithmetic: {ast.dump(node)[:60]}")

    value = walk(ast.parse(expression, mode="eval").body)
    return str(int(value)) if float(value).is_integer() else f"{value:.4g}"


async def _calculate(ctx, arguments: str) -> str:
    try:
        return evaluate(json.loads(arguments)["expression"])
    except (ValueError, KeyError, TypeError, SyntaxError, ZeroDivisionError) as e:
        return f"error: {e}"


def agent_for(client, temperature: float = 1.0, max_tokens: int = 48) -> Agent:
    tool = FunctionTool(name=CALCULATOR["name"], description=CALCULATOR["description"],
                        params_json_schema=CALCULATOR["parameters"], on_invoke_tool=_calculate,
                        strict_json_schema=False)
    return Agent(name="calculator", instructions=SYSTEM, tools=[tool],
                 model=OpenAIChatCompletionsModel(model="flywheel", openai_client=client),
                 model_settings=ModelSettings(temperature=temperature, top_p=1.0, max_tokens=max_tokens))


async def play(task: dict, client) -> float:
    """One episode: the question to the agent, up to 3 model turns; reward 1 for the right answer."""
    result = await Runner.run(agent_for(client), task["question"], max_turns=3,
                              run_config=RunConfig(tracing_disabled=True))
    answer = str(result.final_output or "")
    return float(answer.strip().removeprefix("Answer:").strip() == str(task["answer"]))
