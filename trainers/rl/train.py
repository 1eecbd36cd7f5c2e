"""The RL training job: a checkpoint and an RL dataset in, a trained checkpoint out.

    check the dataset -> advantages (verl) -> the policy (QAT-prepared with the serving spec)
    -> epochs x minibatches of `rl_loss` steps -> save (rank 0) -> PolicyCheckpoint

The same function runs in this process (world 1) and in each Ray Train worker (trainers/rl/
launch.py passes rank and world; torch.distributed is already set up there). Data parallelism is
explicit and small: every rank reads the whole (small) split and draws the same shuffle, takes
its slice of each global minibatch, and the gradients are summed across ranks before clipping;
verl's agg_loss scales each rank's loss to its share of the global minibatch, so N ranks take
the step 1 rank takes on the same global batch. The proximal logprobs of each visit are shared
across ranks (a row may land on another rank next epoch).
"""

from __future__ import annotations

import math
import os
import shutil
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from datetime import datetime, timezone
from pathlib import Path

import torch
from tqdm.auto import tqdm

from rollout.artifacts import MANIFEST, checkpoint_sha256, file_sha256
from trainers.rl.config import RLConfig
from trainers.rl.data import Episodes, check_dataset, load_episodes
from trainers.rl.manifest import PolicyCheckpoint, save_manifest
from trainers.rl.step import global_batch_info, rl_loss, token_logprobs

SHARE_MIN = 8  # a group's common prefix shorter than this is computed per row
PLAIN_MEAN = ("loss", "pg/loss", "kl_ref")  # already each rank's share of the global value x world
_WEIGHTS = (".safetensors", ".bin")
_WRITTEN = (MANIFEST, "model.safetensors.index.json", "config.json", "generation_config.json")  # by save()


@dataclass(frozen=True)
class TrainJob:
    """One training run, as plain data (it crosses to Ray workers)."""

    parent: str  # Hugging Face folder with full-precision weights
    dataset: str  # RL dataset folder (pipelines/traces_to_dataset)
    out_dir: str  # the checkpoint folder to create (must not exist)
    rl: RLConfig
    spec: dict | None = None  # the serving QuantSpec (to_dict()); QAT trains through it when rl.qat
    # linear layers the serving layer plan keeps in full precision: QAT leaves them unquantized, as
    # the server runs them (config.json `ignore` of the served folder; lm_head is never quantized)
    full_precision: tuple[str, ...] = ()

    def absolute(self) -> "TrainJob":
        """The job with absolute paths: a Ray worker runs in a directory of its own."""
        return replace(self, parent=str(Path(self.parent).resolve()), dataset=str(Path(self.dataset).resolve()),
                       out_dir=str(Path(self.out_dir).resolve()))

    def check(self) -> None:
        if Path(self.out_dir).exists():
            raise FileExistsError(f"out_dir {self.out_dir} exists: a checkpoint folder is written once")
        if not (Path(self.parent) / "config.json").is_file():
            raise FileNotFoundError(f"parent {self.parent} is not a Hugging Face folder (no config.json)")
        if self.rl.qat and self.spec is None:
            raise ValueError("qat is on but no serving spec was given (the format served without quantization "
                             "needs trainer.qat=false)")


def prepare_policy(parent: str, rl: RLConfig, spec: dict | None, full_precision: tuple[str, ...] = ()):
    """The model to train: the parent's weights in `rl.dtype`, QAT-prepared with `spec` when `rl.qat`
    (all linear layers but lm_head and `full_precision`)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(parent, dtype=getattr(torch, rl.dtype))
    if rl.qat:
        from kernels import QuantSpec
        from trainers.qat import quantize_

        quantize_(model, QuantSpec.from_dict(spec), "prepare", full_precision=full_precision)
    return model


def train(job: TrainJob, report: Callable[[int, dict], None] = lambda step, m: None, rank: int = 0,
          world: int = 1, device: str = "cpu", node: str = "") -> PolicyCheckpoint | None:
    """Run the job; rank 0 saves and returns the manifest (other ranks return None). `node`: where
    this rank runs (the manifest lists every rank's)."""
    from trainers.qat import fake_quant_once

    t_start = time.perf_counter()
    rl = job.rl
    job.check()
    torch.manual_seed(rl.seed)
    dataset = check_dataset(job.dataset)
    episodes = load_episodes(dataset, rl.adv_estimator, rl.norm_adv_by_std, rl.min_group_size)
    model = prepare_policy(job.parent, rl, job.spec, job.full_precision).to(device)
    model.train()
    ref = None
    if rl.kl_coef > 0:
        ref = prepare_policy(job.parent, rl, job.spec, job.full_precision).to(device).eval().requires_grad_(False)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=rl.lr, betas=rl.betas, weight_decay=rl.weight_decay)
    batches = minibatch_plan(episodes.group_ids, rl, world)
    sched = lr_schedule(opt, rl, len(batches))
    pad_id = model.config.pad_token_id if model.config.pad_token_id is not None else 0
    proximal: list[torch.Tensor | None] = [None] * len(episodes)
    prox_s = 0.0
    if rl.proximal == "job_start":
        t_prox = time.perf_counter()
        proximal = start_logprobs(model, episodes, rl, pad_id, device)
        prox_s = time.perf_counter() - t_prox
    history: list[dict] = []
    bar = tqdm(total=len(batches), desc="RL", unit="step", disable=rank != 0 or not rl.progress)
    for step, (epoch, rows) in enumerate(batches, 1):
        t0 = time.perf_counter()
        mine = rows.tensor_split(world)[rank]
        width = max(int(episodes.input_ids[i].numel()) for i in rows)  # the global minibatch's
        share = SHARE_MIN if rl.prefix_rows > 1 else None
        mb = episodes.minibatch(mine, pad_id, width=width, share_prefix=share).to(device)
        global_tokens = int(sum(episodes.loss_mask[i].sum() for i in rows))
        info = global_batch_info(rl, global_tokens, len(rows), world)
        with fake_quant_once(model):
            logprobs, entropy = token_logprobs(model, mb, with_entropy=True, entropy_grad=rl.entropy_coeff > 0)
        prox = torch.stack([p if p is not None else lp for p, lp in
                            zip(pad_rows([proximal[i] for i in mine.tolist()], width - 1), logprobs.detach())])
        ref_lp = None
        if ref is not None:
            with torch.no_grad(), fake_quant_once(ref):
                ref_lp, _ = token_logprobs(ref, mb)
        out = rl_loss(logprobs, prox, mb, rl, info, entropy=entropy, ref_logprobs=ref_lp)
        opt.zero_grad(set_to_none=True)
        out.loss.backward()
        sum_gradients(params, world)
        grad_norm = float(torch.nn.utils.clip_grad_norm_(params, rl.grad_clip))
        opt.step()
        sched.step()
        if rl.proximal == "previous_visit":
            for i, lp in zip(rows.tolist(), gather_rows(logprobs.detach(), rows, world)):
                proximal[i] = lp[:episodes.loss_mask[i].numel()].cpu()
        seconds = time.perf_counter() - t0
        metrics = reduce_metrics(out.metrics, mb.tokens, world)
        metrics.update({"grad_norm": grad_norm, "lr": sched.get_last_lr()[0], "epoch": epoch,
                        "reward/mean": float(episodes.rewards[rows].mean()), "tokens": global_tokens,
                        "tokens_per_s": global_tokens / seconds, "step_seconds": seconds,
                        "proximal_forward_s": prox_s})
        history.append({"step": step, **metrics})
        report(step, metrics)
        bar.update()
        bar.set_postfix(loss=f"{metrics['loss']:.4f}", reward=f"{metrics['reward/mean']:.2f}")
    bar.close()
    divergence = rank_divergence(params, world)
    nodes = [node]
    if world > 1:
        nodes = [""] * world
        torch.distributed.all_gather_object(nodes, node)
    if rank != 0:
        return None
    return save(model, job, episodes, history, time.perf_counter() - t_start, world, divergence, nodes)


def minibatch_plan(group_ids: list[str], rl: RLConfig, world: int) -> list[tuple[int, torch.Tensor]]:
    """(epoch, global rows) per optimizer step. Each epoch, with a seeded shuffle, every group is
    cut into pieces of `rl.prefix_rows` rows, the pieces are shuffled and cut into minibatches of
    at least `minibatch_episodes` rows (a piece's rows sit together: its prompt is computed once);
    a last one smaller than `world` rows is dropped; at most `max_steps` of them. Pieces of one
    row: the usual shuffle of episodes."""
    groups: dict[str, list[int]] = {}
    for i, g in enumerate(group_ids):
        groups.setdefault(g, []).append(i)
    gen = torch.Generator().manual_seed(rl.seed)
    plan = []
    for epoch in range(rl.epochs):
        pieces = []
        for members in groups.values():
            mixed = [members[k] for k in torch.randperm(len(members), generator=gen).tolist()]
            pieces += [mixed[s:s + rl.prefix_rows] for s in range(0, len(mixed), rl.prefix_rows)]
        rows: list[int] = []
        for k in torch.randperm(len(pieces), generator=gen).tolist():
            rows += pieces[k]
            if len(rows) >= rl.minibatch_episodes:
                plan.append((epoch, torch.tensor(rows)))
                rows = []
        if len(rows) >= world:
            plan.append((epoch, torch.tensor(rows)))
    return plan[:rl.max_steps]


def lr_schedule(opt, rl: RLConfig, total_steps: int):
    from verl.utils.torch_functional import get_constant_schedule_with_warmup, get_cosine_schedule_with_warmup

    if rl.lr_schedule == "cosine":
        return get_cosine_schedule_with_warmup(opt, rl.warmup_steps, max(total_steps, 1))
    return get_constant_schedule_with_warmup(opt, rl.warmup_steps)


@torch.no_grad()
def start_logprobs(model, episodes: Episodes, rl: RLConfig, pad_id: int, device: str) -> list[torch.Tensor]:
    """Every train episode's logprobs under the policy as it starts (no grad), in minibatches of
    `rl.minibatch_episodes`: the fixed PPO old policy of `proximal: job_start`. Each rank computes
    them all (the same numbers everywhere; one forward of the train split)."""
    from trainers.qat import fake_quant_once

    out: list[torch.Tensor] = []
    for start in range(0, len(episodes), rl.minibatch_episodes):
        rows = list(range(start, min(start + rl.minibatch_episodes, len(episodes))))
        mb = episodes.minibatch(rows, pad_id).to(device)
        with fake_quant_once(model):
            lp, _ = token_logprobs(model, mb)
        out += [lp[j, :episodes.loss_mask[i].numel()].cpu() for j, i in enumerate(rows)]
    return out


def pad_rows(rows: list[torch.Tensor | None], width: int) -> list[torch.Tensor | None]:
    return [None if r is None else torch.nn.functional.pad(r, (0, width - r.numel())) for r in rows]


def sum_gradients(params: list[torch.Tensor], world: int) -> None:
    """Average the ranks' gradients (each rank's loss is already scaled by `world`: verl's agg_loss)."""
    if world == 1:
        return
    import torch.distributed as dist

    grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat)
    flat /= world
    offset = 0
    for p in params:
        k = p.numel()
        p.grad = flat[offset:offset + k].view_as(p).clone()
        offset += k


def rank_divergence(params: list[torch.Tensor], world: int) -> float:
    """max |w_rank - w_other| over all weights: 0 when the ranks hold the same model, as they must."""
    if world == 1:
        return 0.0
    import torch.distributed as dist

    flat = torch.cat([p.detach().reshape(-1).float() for p in params])
    hi, lo = flat.clone(), flat.clone()
    dist.all_reduce(hi, op=dist.ReduceOp.MAX)
    dist.all_reduce(lo, op=dist.ReduceOp.MIN)
    return float((hi - lo).max())


def gather_rows(local: torch.Tensor, rows: torch.Tensor, world: int) -> list[torch.Tensor]:
    """Every rank's rows of a (b_rank, L) tensor, in the order of `rows` (its tensor_split)."""
    if world == 1:
        return list(local)
    import torch.distributed as dist

    sizes = [len(s) for s in rows.tensor_split(world)]
    padded = torch.zeros((max(sizes), local.shape[1]), dtype=local.dtype, device=local.device)
    padded[:len(local)] = local
    parts = [torch.empty_like(padded) for _ in range(world)]
    dist.all_gather(parts, padded)
    return [r for part, k in zip(parts, sizes) for r in part[:k]]


def reduce_metrics(metrics: dict[str, float], tokens: int, world: int) -> dict[str, float]:
    """Across ranks: token-weighted means, except maxima (max), minima (min) and PLAIN_MEAN keys."""
    if world == 1:
        return dict(metrics)
    import torch.distributed as dist

    keys = sorted(metrics)
    vals = torch.tensor([metrics[k] for k in keys], dtype=torch.float64)
    weighted = torch.tensor([*(vals * tokens).tolist(), float(tokens)], dtype=torch.float64)
    plain, hi, lo = vals.clone(), vals.clone(), vals.clone()
    dist.all_reduce(weighted)
    dist.all_reduce(plain)
    dist.all_reduce(hi, op=dist.ReduceOp.MAX)
    dist.all_reduce(lo, op=dist.ReduceOp.MIN)
    out = {}
    for j, k in enumerate(keys):
        if k in PLAIN_MEAN:
            out[k] = float(plain[j]) / world
        elif k.endswith("max"):
            out[k] = float(hi[j])
        elif k.endswith("min"):
            out[k] = float(lo[j])
        else:
            out[k] = float(weighted[j] / max(weighted[-1], 1.0))
    return out


def save(model, job: TrainJob, episodes: Episodes, history: list[dict], seconds: float, world: int,
         divergence: float = 0.0, nodes: list[str] = ()) -> PolicyCheckpoint:
    """The latent weights (a QAT-prepared model saves its full-precision Parameters under the
    usual keys), the parent's tokenizer files, then the manifest; renamed into place."""
    out = Path(job.out_dir)
    tmp = out.parent / f".{out.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        model.save_pretrained(str(tmp), safe_serialization=True)
        for f in sorted(Path(job.parent).iterdir()):
            if f.is_file() and f.suffix not in _WEIGHTS and f.name not in _WRITTEN and not (tmp / f.name).exists():
                shutil.copy2(f, tmp / f.name)
        files = {p.relative_to(tmp).as_posix(): file_sha256(p) for p in sorted(tmp.rglob("*")) if p.is_file()}
        manifest = PolicyCheckpoint(
            path=str(out.resolve()), parent=str(Path(job.parent).resolve()), parent_sha256=checkpoint_sha256(job.parent),
            dataset=str(Path(job.dataset).resolve()),
            dataset_manifest_sha256=file_sha256(Path(job.dataset) / MANIFEST), spec=job.spec if job.rl.qat else None,
            config=asdict(job.rl), data=episodes.counts, history=history,
            metrics={**summarize(history, seconds), "ranks_max_param_diff": divergence},
            wall_seconds=round(seconds, 2), world_size=world, files=files,
            created_at=datetime.now(timezone.utc).isoformat(), adv_estimator=episodes.estimator,
            adv_estimator_reason=episodes.estimator_reason, nodes=list(nodes))
        save_manifest(manifest, tmp)
        tmp.rename(out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return manifest


def summarize(history: list[dict], seconds: float) -> dict[str, float]:
    if not history:
        return {"steps": 0, "seconds": round(seconds, 2)}
    tokens = sum(h["tokens"] for h in history)
    step_s = sum(h["step_seconds"] for h in history)
    return {"steps": len(history), "tokens": tokens, "seconds": round(seconds, 2),
            "step_seconds": round(step_s, 2), "tokens_per_s": tokens / step_s if step_s else math.nan,
            "loss_first": history[0]["loss"], "loss_last": history[-1]["loss"],
            "mismatch_first": history[0]["mismatch/train_vs_behaviour"],
            "mismatch_last": history[-1]["mismatch/train_vs_behaviour"],
            "reward_mean": sum(h["reward/mean"] for h in history) / len(history)}
