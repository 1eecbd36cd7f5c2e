"""The SQL task: questions about a shop's sales, answered from its SQLite database through three
tools over a per-episode connection: `list_tables`, `describe_table` and `query`.

An episode (the demonstration):

    user:      "Shop 4821: how many lamps did Eva buy?"
    assistant: list_tables({})                      tool: "customers, sales"
    assistant: describe_table({"table": "sales"})   tool: "id INTEGER, customer TEXT, item TEXT, qty INTEGER"
    assistant: query({"sql": "SELECT SUM(qty) FROM sales WHERE customer = 'Eva' AND item = 'lamps'"})
                                                    tool: "7"
    assistant: "Answer: 7"

Each shop's database is built from its number (`shop_db`): its customers, what they bought and how
many, so a question's answer is recomputed from its text alone (`problem_from_question`), as
rewards of logged episodes need. Every shop has the same schema: with the sales table's name and
two column names drawn per shop (12 schemas), the default tiny model reached 3% sampled success
after 400 SFT steps, every failure a table or column name not copied out of a tool's result.
`SCHEMAS` holds the variants for a model that can learn them. The train and eval splits partition the question texts by hash.
`reward` is exact: 1.0 iff the episode ran a well-formed `query` and its final answer equals the
gold query's result; the answer has to come from the database, it cannot be copied from the
question. Queries run read-only, bounded in length and in steps.
"""

from __future__ import annotations

import hashlib
import json
import random
import re
import sqlite3
from dataclasses import dataclass
from functools import lru_cache

from rollout.tasks import FunctionTask, parse_arguments

SYSTEM_PROMPT = "Answer from the shop's database: find its sales table, read its columns, query it, then answer."


def _tool(name: str, description: str, properties: dict) -> dict:
    return {"type": "function", "function": {
        "name": name, "description": description,
        "parameters": {"type": "object", "properties": properties, "required": sorted(properties)}}}


TOOLS = [
    _tool("list_tables", "The database's tables.", {}),
    _tool("describe_table", "A table's columns.", {"table": {"type": "string"}}),
    _tool("query", "Run a read-only SQL query.", {"sql": {"type": "string"}}),
]

NAMES = ["Ann", "Ben", "Cai", "Dev", "Eva", "Fay", "Gus", "Hal", "Ida", "Joe", "Kim", "Lea"]
ITEMS = ["pens", "cups", "books", "lamps", "bags", "hats", "maps", "rugs"]
# (sales table, customer column, quantity column) a shop's schema is drawn from
SCHEMAS = [("sales", "customer", "qty")]

# (question, gold SQL) over {shop}, {name}, {item}; the schema's names fill {t}, {c}, {q}
TEMPLATES: list[tuple[str, str]] = [
    ("Shop {shop}: how many {item} did {name} buy?", "SELECT SUM({q}) FROM {t} WHERE {c} = '{name}' AND item = '{item}'"),
    ("Shop {shop}: how many orders did {name} place?", "SELECT COUNT(*) FROM {t} WHERE {c} = '{name}'"),
    ("Shop {shop}: how many {item} were sold in total?", "SELECT SUM({q}) FROM {t} WHERE item = '{item}'"),
    ("Shop {shop}: what was the largest order of {item}?", "SELECT MAX({q}) FROM {t} WHERE item = '{item}'"),
    ("Shop {shop}: how many customers bought {item}?", "SELECT COUNT(DISTINCT {c}) FROM {t} WHERE item = '{item}'"),
]
ANSWER_RE = re.compile(r"^\s*Answer:\s*(-?\d+)\s*$")
MAX_SQL_CHARS = 300
MAX_STEPS = 100_000  # SQLite VM steps a query may take (a cross join of every table is far below)


@dataclass(frozen=True)
class Shop:
    number: int
    table: str
    customer: str  # the sales table's customer column
    quantity: str  # and its quantity column
    rows: tuple[tuple[str, str, int], ...]  # (customer, item, quantity)
    cities: tuple[tuple[str, str], ...]  # the customers table: (name, city)


@lru_cache(maxsize=4096)
def shop(number: int) -> Shop:
    """Shop `number`'s data, the same on every machine."""
    rng = random.Random(f"shop:{number}")
    table, customer, quantity = rng.choice(SCHEMAS)
    names, items = rng.sample(NAMES, 4), rng.sample(ITEMS, 4)
    rows = tuple((rng.choice(names), rng.choice(items), rng.randint(1, 9)) for _ in range(rng.randint(8, 14)))
    cities = tuple((n, rng.choice(["Oslo", "Lima", "Pune", "Kobe"])) for n in sorted(names))
    return Shop(number, table, customer, quantity, rows, cities)


def shop_db(number: int) -> sqlite3.Connection:
    """A fresh in-memory database of shop `number`, read-only once filled."""
    s = shop(number)
    db = sqlite3.connect(":memory:", check_same_thread=False)
    db.execute("CREATE TABLE customers (name TEXT, city TEXT)")
    db.executemany("INSERT INTO customers VALUES (?, ?)", s.cities)
    db.execute(f"CREATE TABLE {s.table} (id INTEGER, {s.customer} TEXT, item TEXT, {s.quantity} INTEGER)")
    db.executemany(f"INSERT INTO {s.table} VALUES (?, ?, ?, ?)", [(i + 1, *r) for i, r in enumerate(s.rows)])
    db.commit()
    db.execute("PRAGMA query_only = ON")
    return db


def _rows_text(rows: list[tuple]) -> str:
    if not rows:
        return "no rows"
    text = "\n".join(", ".join("NULL" if v is None else str(v) for v in row) for row in rows[:10])
    return text + (f"\n... {len(rows) - 10} more rows" if len(rows) > 10 else "")


class ShopEnv:
    """One episode's connection to its shop's database; the tools' results are text."""

    def __init__(self, number: int):
        self.db = shop_db(number)
        steps = [0]

        def budget() -> int:  # called every 1000 VM steps: a nonzero return aborts the query
            steps[0] += 1000
            return int(steps[0] > MAX_STEPS)

        self._steps = steps
        self.db.set_progress_handler(budget, 1000)

    def call(self, name: str, arguments: str) -> str:
        args = parse_arguments(arguments)
        if args is None:
            return "error: arguments must be a JSON object"
        if name == "list_tables":
            return ", ".join(r[0] for r in self.db.execute("SELECT name FROM sqlite_master WHERE type = 'table' ORDER BY name"))
        if name == "describe_table":
            table = args.get("table")
            cols = self.db.execute("SELECT name, type FROM pragma_table_info(?)", (table,)).fetchall() if isinstance(table, str) else []
            return ", ".join(f"{c} {t}" for c, t in cols) if cols else f"error: no table named {table!r}"
        if name == "query":
            sql = args.get("sql")
            if not isinstance(sql, str) or not sql.strip():
                return "error: sql must be a string"
            if len(sql) > MAX_SQL_CHARS:
                return f"error: a query is at most {MAX_SQL_CHARS} characters"
            self._steps[0] = 0
            try:
                return _rows_text(self.db.execute(sql).fetchall())
            except (sqlite3.Error, sqlite3.Warning, ValueError) as e:
                return f"error: {e}"
        return f"error: no tool named {name!r}"


@dataclass(frozen=True)
class Problem:
    id: str
    question: str
    shop: int
    sql: str  # the gold query, in the shop's own names (for demonstrations)
    answer: int

    def messages(self) -> list[dict]:
        return [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": self.question}]


def _problem(pid: str, template: int, number: int, name: str, item: str) -> Problem:
    text, sql = TEMPLATES[template]
    s = shop(number)
    sql = sql.format(t=s.table, c=s.customer, q=s.quantity, name=name, item=item)
    (value,), = shop_db(number).execute(sql).fetchall()
    return Problem(pid, text.format(shop=number, name=name, item=item), number, sql, int(value))


HELD_OUT_BUCKETS = 10


def held_out(question: str) -> bool:
    """Whether a question is in the eval pool (a hash of its text: the same on every machine)."""
    return int(hashlib.sha256(question.encode()).hexdigest()[:8], 16) % HELD_OUT_BUCKETS == 0


def make_problems(split: str, n: int, seed: int | str = 0) -> list[Problem]:
    """`n` problems of `split` ("train" or "eval") drawn with `seed`; no question is in both splits."""
    if split not in ("train", "eval"):
        raise ValueError(f"split must be 'train' or 'eval', got {split!r}")
    rng = random.Random(f"sql:{split}:{seed}")
    out = []
    while len(out) < n:
        number, template = rng.randrange(10_000), rng.randrange(len(TEMPLATES))
        name, item, _ = rng.choice(shop(number).rows)  # a pair the shop sold: no empty sums
        p = _problem(f"{split}-{seed}-{len(out)}", template, number, name, item)
        if held_out(p.question) == (split == "eval"):
            out.append(p)
    return out


_QUESTION_RES = [re.compile(re.escape(text).replace(re.escape("{shop}"), r"(?P<shop>\d{1,4})")
                            .replace(re.escape("{name}"), r"(?P<name>[A-Z][a-z]+)")
                            .replace(re.escape("{item}"), r"(?P<item>[a-z]+)") + "$") for text, _ in TEMPLATES]


def problem_from_question(question: str) -> Problem | None:
    """The problem (and its answer) a question asks, or None if it is none of this task's."""
    for k, regex in enumerate(_QUESTION_RES):
        m = regex.match(question.strip())
        if m:
            g = m.groupdict()
            return _problem(f"q-{hashlib.sha256(question.encode()).hexdigest()[:12]}", k, int(g["shop"]),
                            g.get("name", ""), g.get("item", ""))
    return None


def demonstration(problem: Problem) -> list[dict]:
    """The ideal episode, as OpenAI messages (for SFT): look, describe, query, answer."""
    env, s = ShopEnv(problem.shop), shop(problem.shop)
    out = problem.messages()
    for name, args in (("list_tables", {}), ("describe_table", {"table": s.table}), ("query", {"sql": problem.sql})):
        call = {"id": "call_0", "type": "function", "function": {"name": name, "arguments": json.dumps(args)}}
        out += [{"role": "assistant", "content": "", "tool_calls": [call]},
                {"role": "tool", "tool_call_id": "call_0", "content": env.call(name, json.dumps(args))}]
    return out + [{"role": "assistant", "content": f"Answer: {problem.answer}"}]


def _queried(messages: list[dict]) -> bool:
    for m in messages:
        for c in (m.get("tool_calls") or []) if m["role"] == "assistant" else []:
            args = parse_arguments(c.get("function", {}).get("arguments"))
            if c.get("function", {}).get("name") == "query" and args is not None and isinstance(args.get("sql"), str):
                return True
    return False


def reward(problem: Problem, messages: list[dict]) -> float:
    """1.0 iff the episode ran a well-formed query and its last turn answers the gold result.

    >>> p = make_problems("eval", 1)[0]
    >>> reward(p, demonstration(p)), reward(p, demonstration(p)[:2] + [{"role": "assistant", "content": f"Answer: {p.answer}"}])
    (1.0, 0.0)
    """
    turns = [m for m in messages if m["role"] == "assistant"]
    if not turns or turns[-1].get("tool_calls") or not _queried(messages):
        return 0.0
    m = ANSWER_RE.match(turns[-1].get("content") or "")
    return float(m is not None and int(m.group(1)) == problem.answer)


def env(problem: Problem) -> ShopEnv:
    return ShopEnv(problem.shop)


TASK = FunctionTask("sql", TOOLS, max_turns=5,  # the demonstration's 4, and one to recover from an error
                    max_tokens=64, feedback_source="env:sql", problems=make_problems,
                    env=env, reward=reward, demonstration=demonstration,
                    problem_of=problem_from_question, version=2)  # 2: one schema for every shop
