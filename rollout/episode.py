"""Agent episodes, token-in/token-out, over any generation backend.

An episode is played turn by turn on token ids: turn k+1's prompt is exactly turn k's prompt,
plus the tokens the policy sampled (ending in its end-of-turn token), plus the tool result and the
next generation prompt as the model's chat template renders them (`rollout.chat`, any template;
tool calls read by vLLM's parser for it). Nothing is re-tokenized, so the token ids and behaviour logprobs that an
episode records are exactly what the engine saw and produced.

A backend is a `Generate` callable: prompts (lists of token ids) -> one `Completion` each. The
offline vLLM engine, a transformers model and the HTTP endpoint all fit behind it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Protocol

from rollout.chat import ChatFormat
from rollout.tasks import Env, Problem, Task


@dataclass
class Completion:
    token_ids: list[int]
    logprobs: list[float] | None = None  # behaviour logprob of each sampled token
    finish_reason: str = "stop"  # "stop" | "length"


class Generate(Protocol):
    def __call__(self, prompts: list[list[int]], temperature: float, max_tokens: int) -> list[Completion]: ...


@dataclass
class Turn:
    prompt_ids: list[int]
    completion: Completion


@dataclass
class Episode:
    problem: Problem
    messages: list[dict]
    turns: list[Turn] = field(default_factory=list)
    reward: float = 0.0
    done: bool = False


def agent_step(chat: ChatFormat, env: Env, token_ids: list[int], finish_reason: str) -> tuple[dict, list[dict] | None]:
    """The agent's side of one sampled turn: the assistant message it parses, and the tool messages
    answering its calls from the episode's environment when the turn is a finished tool call
    (None: the episode ends here)."""
    eos = chat.tokenizer.eos_token_id
    ids = token_ids[:-1] if token_ids and token_ids[-1] == eos else token_ids
    msg = chat.parse(chat.tokenizer.decode(ids, skip_special_tokens=False))
    if finish_reason != "stop" or not msg["tool_calls"]:
        return msg, None
    return msg, [{"role": "tool", "tool_call_id": c["id"], "content": env.call(c["function"]["name"], c["function"]["arguments"])}
                 for c in msg["tool_calls"]]


def after_turn(chat: ChatFormat, messages: list[dict], results: list[dict]) -> tuple[list[dict], list[int]]:
    """The tool messages answering the last assistant turn's calls, appended to `messages`, and the
    ids that follow the turn's end-of-turn token: the results as the template renders them, and
    the next generation prompt."""
    messages = messages + results
    return messages, chat.after_turn(messages)


def run_episodes(
    problems: list[Problem],
    tokenizer,
    generate: Generate | Callable,
    *,
    task: Task,
    temperature: float,
    max_tokens: int | None = None,
    max_turns: int | None = None,
) -> list[Episode]:
    """Play one episode of `task` per problem (at most `max_turns` of at most `max_tokens` each,
    defaults the task's), batching each turn across the episodes still running."""
    chat = ChatFormat.of(tokenizer, task.tools)
    episodes = [Episode(p, p.messages()) for p in problems]
    envs = [task.env(p) for p in problems]
    prompts = [chat.prompt(p.messages()) for p in problems]
    for _ in range(max_turns or task.max_turns):
        live = [i for i, e in enumerate(episodes) if not e.done]
        if not live:
            break
        outs = generate([prompts[i] for i in live], temperature=temperature, max_tokens=max_tokens or task.max_tokens)
        for i, out in zip(live, outs):
            ep = episodes[i]
            ep.turns.append(Turn(prompts[i], out))
            msg, results = agent_step(chat, envs[i], out.token_ids, out.finish_reason)
            ep.messages.append(msg)
            if results is None:
                ep.done = True
                continue
            ep.messages, more = after_turn(chat, ep.messages, results)
            prompts[i] = prompts[i] + list(out.token_ids) + more
    for ep in episodes:
        ep.done = True
        ep.reward = task.reward(ep.problem, ep.messages)
    return episodes


def success_rate(episodes: list[Episode]) -> float:
    return sum(e.reward for e in episodes) / max(1, len(episodes))


def hf_generate(model, tokenizer):
    """A `Generate` backend on a transformers model (the SFT bootstrap's evals)."""
    import torch

    eos, pad = tokenizer.eos_token_id, tokenizer.pad_token_id

    @torch.no_grad()
    def generate(prompts: list[list[int]], temperature: float, max_tokens: int) -> list[Completion]:
        width = max(map(len, prompts))
        ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])
        attn = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
        sample = temperature > 0
        out = model.generate(
            input_ids=ids, attention_mask=attn, max_new_tokens=max_tokens, do_sample=sample,
            temperature=temperature if sample else None, top_k=None, top_p=None,
            eos_token_id=eos, pad_token_id=pad,
        )[:, width:].tolist()
        done = []
        for row in out:
            if eos in row:
                done.append(Completion(row[: row.index(eos) + 1], finish_reason="stop"))
            else:
                done.append(Completion(row, finish_reason="length"))
        return done

    return generate
