"""Distill a draft from its target on the target's own traffic: traces -> a draft HF folder + manifest.

    recent ok requests of the serving version ─▶ train / held-out (by trace id)
    draft: the previous one (warm start, same shape) or a new small model on the target's config
    steps x [target forward (no grad) ─▶ soft targets at the serving temperature;
             loss = soft_weight x KL(p_target || q_draft) + hard_weight x CE(served tokens)]
    offline acceptance (pipelines/speculator/acceptance.py) of the start and the trained draft
    ─▶ <out>/ (safetensors, the target's tokenizer files, flywheel_manifest.json), renamed into place

Only completion positions (what the target sampled, what a draft is asked to propose) enter the loss.
"""

from __future__ import annotations

import os
import shutil
import time
from collections.abc import Callable
from dataclasses import asdict
from datetime import datetime, timezone
from pathlib import Path

import torch
from torch.nn import functional as F
from tqdm.auto import tqdm

from rollout.artifacts import checkpoint_sha256
from pipelines.logits import Sequences, batches
from pipelines.speculator.acceptance import expected_acceptance
from pipelines.speculator.config import DraftShape, SpeculatorConfig, SpeculatorManifest
from pipelines.speculator.data import traffic_sequences

_WEIGHTS = (".safetensors", ".bin")
_WRITTEN = ("flywheel_manifest.json", "config.json", "generation_config.json", "model.safetensors.index.json")


def new_draft(target_config, shape: DraftShape, seed: int = 0):
    """A randomly initialised draft: the target's architecture and vocabulary at `shape`."""
    from transformers import AutoModelForCausalLM

    cfg = target_config.__class__.from_dict(target_config.to_dict())
    cfg.hidden_size, cfg.num_hidden_layers = shape.hidden_size, shape.num_layers
    cfg.num_attention_heads, cfg.num_key_value_heads = shape.num_heads, shape.num_kv_heads
    cfg.intermediate_size, cfg.head_dim = shape.intermediate_size, shape.hidden_size // shape.num_heads
    if hasattr(cfg, "layer_types"):
        cfg.layer_types = ["full_attention"] * shape.num_layers
    if hasattr(cfg, "max_window_layers"):
        cfg.max_window_layers = shape.num_layers
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)


def load_model(folder: str | Path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()


def start_draft(target, cfg: SpeculatorConfig, parent: str | None):
    """The parent draft when warm-starting from one of the configured shape, else a new one."""
    if parent and cfg.warm_start:
        draft = load_model(parent)
        c = draft.config
        same = (c.hidden_size, c.num_hidden_layers, c.num_attention_heads, c.num_key_value_heads,
                c.intermediate_size, c.vocab_size) == (cfg.draft.hidden_size, cfg.draft.num_layers,
                                                       cfg.draft.num_heads, cfg.draft.num_kv_heads,
                                                       cfg.draft.intermediate_size, target.config.vocab_size)
        if same:
            return draft, parent
    return new_draft(target.config, cfg.draft, cfg.seed), None


def distill_loss(draft_logits: torch.Tensor, target_logits: torch.Tensor | None, tokens: torch.Tensor,
                 cfg: SpeculatorConfig) -> tuple[torch.Tensor, dict[str, float]]:
    """[N, V] logits at the scored positions and [N] served tokens -> the loss and its parts."""
    loss, parts = torch.zeros(()), {}
    if cfg.soft_weight > 0:
        t = cfg.temperature if cfg.temperature > 0 else 1.0
        p, q = F.log_softmax(target_logits / t, -1), F.log_softmax(draft_logits / t, -1)
        soft = (p.exp() * (p - q)).sum(-1).mean()
        loss = loss + cfg.soft_weight * soft
        parts["kl"] = float(soft.detach())
    if cfg.hard_weight > 0:
        hard = F.cross_entropy(draft_logits, tokens)
        loss = loss + cfg.hard_weight * hard
        parts["ce"] = float(hard.detach())
    if target_logits is not None:  # hard labels only: no target forward, nothing to compare with
        parts["top1_match"] = float((draft_logits.argmax(-1) == target_logits.argmax(-1)).float().mean())
    return loss, parts


def train_draft(target, draft, train: Sequences, cfg: SpeculatorConfig, progress: bool = True,
                log: Callable[[int, dict], None] = lambda step, m: None) -> list[dict]:
    """`cfg.steps` AdamW steps on random batches of `train` (a seeded draw); returns the history."""
    from verl.utils.torch_functional import get_cosine_schedule_with_warmup

    gen = torch.Generator().manual_seed(cfg.seed)
    opt = torch.optim.AdamW(draft.parameters(), lr=cfg.lr, betas=(0.9, 0.98), weight_decay=0.0)
    sched = get_cosine_schedule_with_warmup(opt, min(cfg.warmup_steps, cfg.steps - 1), cfg.steps)
    draft.train()
    history = []
    for step in tqdm(range(1, cfg.steps + 1), desc="draft", unit="step", disable=not progress):
        rows = torch.randint(len(train.ids), (cfg.batch_size,), generator=gen).tolist()
        batch = Sequences(tuple(train.ids[i] for i in rows), tuple(train.sampled[i] for i in rows), train.source)
        ((x, attn, scored),) = list(batches(batch, cfg.batch_size))
        tokens = x[:, 1:][scored]
        target_logits = None
        if cfg.soft_weight > 0:
            with torch.no_grad():
                target_logits = target(input_ids=x, attention_mask=attn).logits[:, :-1][scored].float()
        logits = draft(input_ids=x, attention_mask=attn).logits[:, :-1][scored].float()
        loss, parts = distill_loss(logits, target_logits, tokens, cfg)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(draft.parameters(), 1.0)
        opt.step()
        sched.step()
        metrics = {"loss": float(loss.detach()), **parts, "lr": sched.get_last_lr()[0]}
        history.append({"step": step, **metrics})
        log(step, metrics)
    draft.eval()
    return history


def save_draft(draft, target: str | Path, folder: str | Path) -> None:
    """The draft's weights and config, with the target's tokenizer files and chat template."""
    folder = Path(folder)
    draft.save_pretrained(str(folder), safe_serialization=True)
    for f in sorted(Path(target).iterdir()):
        if f.is_file() and f.suffix not in _WEIGHTS and f.name not in _WRITTEN and not (folder / f.name).exists():
            shutil.copy2(f, folder / f.name)


def distill(target_path: str | Path, trace_root: str | Path, out_dir: str | Path, cfg: SpeculatorConfig,
            weight_versions: list[int] | None = None, since: datetime | None = None, parent: str | None = None,
            target_version: int | None = None, progress: bool = True,
            log: Callable[[int, dict], None] = lambda step, m: None) -> SpeculatorManifest:
    """Train a draft for the target at `target_path` on its traffic; write it to `out_dir` (new)."""
    t0 = time.perf_counter()
    out = Path(out_dir)
    if out.exists():
        raise FileExistsError(f"out_dir {out} exists: a draft folder is written once")
    train, heldout = traffic_sequences(trace_root, weight_versions, since, cfg.max_requests, cfg.heldout_fraction,
                                       cfg.seed)
    if not train.ids or not heldout.ids:
        raise ValueError(f"{trace_root}: {len(train.ids)} train and {len(heldout.ids)} held-out requests; "
                         "a draft needs both (collect more traffic or raise speculator.heldout_fraction)")
    target = load_model(target_path).requires_grad_(False)
    draft, warm = start_draft(target, cfg, parent)
    pad_id = target.config.pad_token_id or 0

    def offline(model) -> dict:
        return expected_acceptance(target, model, heldout, cfg.num_speculative_tokens, cfg.temperature,
                                   cfg.eval_positions, pad_id=pad_id, seed=cfg.seed).to_dict()

    before = offline(draft)
    history = train_draft(target, draft, train, cfg, progress, log)
    after = offline(draft)
    traces = {"root": str(Path(trace_root).resolve()), "weight_versions": weight_versions,
              "since": since.isoformat() if since else None, "requests": len(train.ids) + len(heldout.ids),
              "train_tokens": train.num_scored, "heldout_tokens": heldout.num_scored}
    tmp = out.parent / f".{out.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        save_draft(draft, target_path, tmp)
        manifest = SpeculatorManifest(
            path=str(out.resolve()), target=str(Path(target_path).resolve()),
            target_sha256=checkpoint_sha256(target_path), target_version=target_version, parent=warm, traces=traces,
            offline=after, offline_before=before, config=asdict(cfg),
            num_parameters=sum(p.numel() for p in draft.parameters()), history=history,
            seconds=round(time.perf_counter() - t0, 2), created_at=datetime.now(timezone.utc).isoformat())
        manifest.save(tmp)
        tmp.rename(out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return manifest



