"""Helpers for the server tests: a real `loop serve` subprocess, checkpoints to swap in, SSE."""

from __future__ import annotations

import json
import tempfile
import threading
from pathlib import Path

import httpx

from rollout.server.process import ServerProcess

REPO = Path(__file__).resolve().parents[3]
ADMIN_TOKEN = "test-admin-token"


class ServerProc(ServerProcess):
    """`loop serve conf/tiny.yaml ...` in a subprocess (rollout/server/process.py), with the tests' admin token."""

    def __init__(self, model: str, trace_root: Path, log_path: Path, overrides: list[str] = (), env: dict | None = None):
        # the tests swap in folders they make under the temp dir, and the session's base (the repo's .cache)
        roots = f"serve.weights_roots=[{tempfile.gettempdir()},{REPO / '.cache'}]"
        super().__init__(REPO / "conf" / "tiny.yaml", model, trace_root, log_path, [roots, *overrides], env, ADMIN_TOKEN)

    def traces(self) -> list[dict]:
        from rollout.traces import read_traces

        self.flush()
        return read_traces(self.trace_root).to_pylist()

    def trace(self, trace_id: str) -> dict:
        rows = [r for r in self.traces() if r["trace_id"] == trace_id]
        assert len(rows) == 1, f"{len(rows)} rows for trace {trace_id}"
        return rows[0]


def placement(root: int) -> tuple[set[int], list[int]]:
    """The cores vLLM bound its workers to under process `root` (empty: none bound to a subset
    of this machine's cores, as on a GPU), and the engine-core pids there."""
    import os

    from rollout.cpu_placement import WORKER_NAME, process_tree

    def comm(pid: int) -> str:
        with open(f"/proc/{pid}/comm") as f:
            return f.read().strip()

    def alive(pid: int) -> bool:  # a retired engine's processes may linger as zombies
        try:
            with open(f"/proc/{pid}/stat") as f:
                return f.read().rsplit(")", 1)[1].split()[0] != "Z"
        except OSError:
            return False

    tree = [p for p in process_tree(root) if alive(p)]
    workers = [p for p in tree if comm(p).startswith(WORKER_NAME)]
    worker_cpus = set().union(*(os.sched_getaffinity(p) for p in workers)) if workers else set()
    if worker_cpus >= os.sched_getaffinity(0):
        worker_cpus = set()
    return worker_cpus, [p for p in tree if comm(p).startswith("VLLM::EngineCor")]


def perturbed_copy(src: str | Path, dst: Path, scale: float = 0.05, seed: int = 1) -> Path:
    """A same-architecture, same-tokenizer checkpoint with different weights."""
    import shutil

    import torch
    from safetensors.torch import load_file, save_file

    dst.mkdir(parents=True, exist_ok=True)
    for p in Path(src).iterdir():
        if p.is_file() and p.suffix != ".safetensors" and p.name != "flywheel_manifest.json":
            shutil.copy(p, dst / p.name)
    g = torch.Generator().manual_seed(seed)
    for shard in Path(src).glob("*.safetensors"):
        tensors = load_file(shard)
        out = {k: (v + scale * v.std() * torch.randn(v.shape, generator=g)).contiguous()
               if v.is_floating_point() and v.ndim == 2 else v for k, v in tensors.items()}
        save_file(out, dst / shard.name, metadata={"format": "pt"})
    write_test_manifest(dst)
    return dst


def write_test_manifest(folder: Path) -> None:
    """A manifest recording the folder's files as they are (the swap loads nothing without one)."""
    from rollout.artifacts import MANIFEST, files_sha256

    (Path(folder) / MANIFEST).write_text(json.dumps({"kind": "test_copy", "files": files_sha256(folder)}))


def chat_messages(text: str = "A box holds 12 pens. How many pens are in 7 boxes?") -> list[dict]:
    from rollout.tasks.calculator import SYSTEM_PROMPT

    return [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": text}]


def sse_events(raw: str) -> list[dict]:
    return [json.loads(e[5:]) for e in raw.split("\n\n") if e.startswith("data:") and e[5:].strip() != "[DONE]"]


PROMPTS = ["Ann has 5 apples and buys 3 more. How many apples does Ann have?",
           "A box holds 12 pens. How many pens are in 7 boxes?"]


class StreamingLoad:
    """`n` threads sending streamed chat requests back to back until stopped. With `stagger_s`,
    thread i starts i * stagger_s late and asks for i * 16 more tokens, so the streams never
    restart in step (a swap that lands as all of them restart finds none mid-way)."""

    def __init__(self, url: str, n: int = 6, max_tokens: int = 32, stagger_s: float = 0.0):
        self.url, self.results, self._stop, self.max_tokens = url, [], threading.Event(), max_tokens
        self.stagger_s, self.streaming = stagger_s, threading.Event()
        self.threads = [threading.Thread(target=self._run, args=(i,), daemon=True) for i in range(n)]

    def _run(self, i: int) -> None:
        self._stop.wait(i * self.stagger_s)
        while not self._stop.is_set():
            body = {"model": "flywheel", "messages": chat_messages(PROMPTS[i % 2]), "stream": True,
                    "max_tokens": self.max_tokens + (16 * i if self.stagger_s else 0), "temperature": 1.0,
                    "ignore_eos": True}
            try:
                with httpx.stream("POST", self.url + "/v1/chat/completions", json=body, timeout=120) as r:
                    raw = ""
                    for chunk in r.iter_text():  # not iter_lines: a token can be U+2028 or \x85, which it splits on
                        raw += chunk
                        if not self.streaming.is_set() and raw.count("data: {") > 4:
                            self.streaming.set()  # a stream is mid-way: tokens came, more will
                    self.results.append((r.status_code, r.headers.get("x-flywheel-trace-id"),
                                         int(r.headers.get("x-flywheel-weight-version", -1)),
                                         raw.rstrip().endswith("data: [DONE]"), raw))
            except httpx.HTTPError as e:
                self.results.append((-1, None, -1, False, repr(e)))

    def __enter__(self):
        for t in self.threads:
            t.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        for t in self.threads:
            t.join(120)


def sampled_row(server, tokenizer, temperature: float, top_p: float, max_tokens: int = 24, seed: int = 3) -> dict:
    """The trace row of one sampled /v1/completions request on the chat prompt (token ids in)."""
    prompt = list(tokenizer.apply_chat_template(chat_messages(), add_generation_prompt=True, tokenize=True,
                                                return_dict=False))  # (a BatchEncoding is not a dict)
    r = httpx.post(server.url + "/v1/completions", timeout=60, json={
        "model": "flywheel", "prompt": prompt, "max_tokens": max_tokens, "temperature": temperature, "top_p": top_p,
        "seed": seed})
    assert r.status_code == 200, r.text
    row = server.trace(r.headers["x-flywheel-trace-id"])
    assert row["sampling"]["logprobs_mode"] == "processed_logprobs"
    assert abs(row["sampling"]["temperature"] - temperature) < 1e-6 and abs(row["sampling"]["top_p"] - top_p) < 1e-6
    return row


def assert_sampling_logprobs(row: dict, model_path: str, temperature: float, top_p: float) -> None:
    """The row's behaviour logprobs are those of the distribution each token was drawn from
    (temperature, then the nucleus, renormalized), recomputed by a float32 transformers forward;
    and the test can tell them from the raw logprobs (before both) on this sample."""
    import torch
    from transformers import AutoModelForCausalLM

    ids, out = row["prompt_token_ids"], row["completion_token_ids"]
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(torch.tensor([ids + out])).logits[0, len(ids) - 1:-1].float() / temperature
    # vLLM's nucleus: drop the tokens whose ascending cumulative probability is <= 1 - top_p. A
    # token within 1e-4 of that edge may fall either side of it in vLLM's float32 (its sort and
    # sums are not ours): both nuclei are computed, and each position must match one of them.
    sorted_logits, order = logits.sort(-1)
    cum = sorted_logits.softmax(-1).cumsum(-1)
    edge = (cum - (1 - top_p)).abs() < 1e-4
    ids = torch.tensor(out)[:, None]

    def nucleus_logprobs(drop):
        drop[:, -1] = False
        kept = torch.full_like(logits, float("-inf")).scatter(-1, order, sorted_logits.masked_fill(drop, float("-inf")))
        return kept.log_softmax(-1).gather(-1, ids)[:, 0]

    got = torch.tensor(row["completion_logprobs"])
    assert torch.isfinite(got).all(), got
    err = torch.minimum((got - nucleus_logprobs((cum <= 1 - top_p) & ~edge)).abs(),
                        (got - nucleus_logprobs((cum <= 1 - top_p) | edge)).abs())
    assert err.max() < 2e-3, err
    raw = (logits * temperature).log_softmax(-1).gather(-1, ids)[:, 0]
    assert (got - raw).abs().max() > 0.05  # the test can tell the two apart on this sample
