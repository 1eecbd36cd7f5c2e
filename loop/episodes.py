"""Episodes a person can read: a sample of each cycle's held-out episodes as MLflow traces.

Per GRPO group the gate scored, the best and the worst episode (by reward) become one MLflow
trace each: the episode as the root span (AGENT), each turn a child (LLM: the new prompt tokens
in, the completion out, timed as served), each tool call a TOOL span (its arguments in, the
result the environment inserted out). The group is the trace's session; the reward and the
gate's per-episode KL (candidate against the serving version) are assessments on it. So the UI's
Traces view shows what the agent did with each checkpoint, next to the cycle's run.
"""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path

from rollout.chat import ChatFormat



def pick(dataset: str, scored: set[str], max_groups: int = 8) -> list[dict]:
    """Best and worst episode (by reward) of up to `max_groups` held-out groups, among the
    episodes in `scored` (all when empty); a one-episode group gives one."""
    import pyarrow.parquet as pq

    rows = [r for f in sorted(Path(dataset).glob("heldout/*.parquet"))
            for r in pq.read_table(f, columns=["episode_id", "group_id", "reward", "trace_ids"]).to_pylist()
            if not scored or r["episode_id"] in scored]
    groups = defaultdict(list)
    for r in rows:
        groups[r["group_id"]].append(r)
    out = []
    for gid in sorted(groups)[:max_groups]:
        ranked = sorted(groups[gid], key=lambda r: (r["reward"], r["episode_id"]))
        best, worst = ranked[-1], ranked[0]
        out.append({**best, "rank": "best"})
        if worst is not best:
            out.append({**worst, "rank": "worst"})
    return out


def _ns(ts) -> int:
    return int(ts.timestamp() * 1e9)


def log_episodes(trace_root: str, tokenizer: str, dataset: str, episode_kl: dict, cycle: int,
                 run_id: str, experiment_id: str, tools: list[dict] | None) -> list[str]:
    """Log the sample as MLflow traces (with assessments); their trace ids."""
    import mlflow
    import pyarrow as pa
    import pyarrow.compute as pc
    from mlflow.entities import AssessmentSource, SpanType
    from transformers import AutoTokenizer

    from rollout.traces import read_traces

    episodes = pick(dataset, set(episode_kl))
    if not episodes:
        return []
    tok = AutoTokenizer.from_pretrained(tokenizer)
    chat = ChatFormat.of(tok, tools)  # the model's own chat format reads the turns back

    def decode(ids):
        return tok.decode(ids, skip_special_tokens=False)
    wanted = [t for e in episodes for t in e["trace_ids"]]
    table = read_traces(trace_root, columns=["trace_id", "turn", "prompt_token_ids", "completion_token_ids", "output",
                                             "created_at", "e2e_ms", "weight_version"])
    table = table.filter(pc.is_in(table["trace_id"], value_set=pa.array(wanted)))
    turns = {r["trace_id"]: r for r in table.to_pylist()}
    ids = []
    for e in episodes:
        rows = [turns[t] for t in e["trace_ids"] if t in turns]
        if not rows:
            continue
        kl = episode_kl.get(e["episode_id"], {})
        root = mlflow.start_span_no_context(
            f"episode {e['episode_id']}", span_type=SpanType.AGENT, experiment_id=experiment_id,
            inputs={"problem": _user_text(chat, decode(rows[0]["prompt_token_ids"]))}, start_time_ns=_ns(rows[0]["created_at"]),
            attributes={"weight_version": rows[0]["weight_version"], "reward": e["reward"], "rank": e["rank"]},
            metadata={"mlflow.trace.session": e["group_id"], "mlflow.sourceRun": run_id},
            tags={"flywheel.cycle": str(cycle), "flywheel.rank": e["rank"], "flywheel.episode_id": e["episode_id"]})
        seen = 0
        for i, r in enumerate(rows):
            start = _ns(r["created_at"])
            end = start + int((r["e2e_ms"] or 0) * 1e6)
            new_prompt = r["prompt_token_ids"][seen:]
            seen = len(r["prompt_token_ids"]) + len(r["completion_token_ids"])
            span = mlflow.start_span_no_context(f"turn {i}", span_type=SpanType.LLM, parent_span=root,
                                                inputs={"prompt": decode(new_prompt)}, start_time_ns=start,
                                                attributes={"weight_version": r["weight_version"]})
            text = decode(r["completion_token_ids"])
            span.end(outputs={"completion": text}, end_time_ns=end)
            calls = chat.parse(text.removesuffix(chat.eot))["tool_calls"]
            if calls and i + 1 < len(rows):
                nxt = rows[i + 1]
                fn = calls[0]["function"]
                tool = mlflow.start_span_no_context(fn["name"] or "tool", span_type=SpanType.TOOL, parent_span=root,
                                                    inputs=_json(fn["arguments"]), start_time_ns=end)
                inserted = decode(nxt["prompt_token_ids"][seen:])
                result = next((m["content"] for m in chat.messages(inserted) if m["role"] == "tool"), inserted)
                tool.end(outputs={"result": result}, end_time_ns=_ns(nxt["created_at"]))
        root.end(outputs={"answer": decode(rows[-1]["completion_token_ids"]), "reward": e["reward"]},
                 end_time_ns=_ns(rows[-1]["created_at"]) + int((rows[-1]["e2e_ms"] or 0) * 1e6))
        ids.append((root.trace_id, e, kl))
    mlflow.flush_trace_async_logging()
    for trace_id, e, kl in ids:
        mlflow.log_feedback(trace_id=trace_id, name="reward", value=float(e["reward"]),
                            source=AssessmentSource("CODE", "flywheel reward_fn"),
                            rationale=f"{e['rank']} episode of its group")
        for side, value in kl.items():
            mlflow.log_feedback(trace_id=trace_id, name=f"gate_kl_{side}", value=value,
                                source=AssessmentSource("CODE", "flywheel KL gate"),
                                rationale={"drift": "mean KL(serving || candidate) over the episode's sampled tokens",
                                           "quant": "mean KL(candidate || its full precision) over the sampled tokens"
                                           }.get(side, side))
    return [t for t, _, _ in ids]


def _user_text(chat, prompt: str) -> str:
    """The last user message of a decoded prompt (the whole prompt when none reads back)."""
    found = [m["content"] for m in chat.messages(prompt) if m["role"] == "user"]
    return found[-1].strip() if found else prompt


def _json(text: str):
    try:
        return json.loads(text)
    except ValueError:
        return {"raw": text}
