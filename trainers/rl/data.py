"""The RL dataset (pipelines/traces_to_dataset) -> the episodes the trainer steps on.

Everything is checked before the first step: the manifest, every file's sha256 (a truncated or
swapped file fails here, naming it), the Parquet schema against DATASET_SCHEMA, the row count
and each row's list lengths. Advantages come from verl's estimator over the whole split, once:
rewards are fixed, so they do not change while training.

Grouped or not. The loop's own collector plays each problem in a GRPO group; an outside agent's
production traffic arrives one episode per prompt. `resolve_estimator` picks verl's estimator
from the data when the config says `auto`: GRPO where every group has `min_group_size` episodes,
REINFORCE++ (returns whitened over the batch: no group needed) where none has, and REINFORCE++
with a group-mean baseline (singletons keep their raw reward, then the batch is whitened) where
both kinds arrive. Group-baseline estimators (grpo, rloo, opo) leave out groups smaller than
`min_group_size`; groups whose rewards are all equal carry no signal under any group baseline and
are left out; a batch whose rewards are all equal has nothing to learn. All of it is counted.

Shapes: an episode of n tokens predicts tokens 1..n-1, so its per-token training tensors have
n-1 entries: entry t is about token t+1 (logits at position t).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch

from rollout.artifacts import file_sha256
from pipelines.dataset.manifest import DATASET_SCHEMA, RLDatasetManifest, load_manifest

SEGMENT_COLUMNS = ("segment", "segments")  # datasets built before re-tokenized episodes were split lack them
COLUMNS = ("episode_id", "group_id", "input_ids", "assistant_mask", "behaviour_logprobs", "weight_versions",
           "temperatures", "reward")


class DatasetError(ValueError):
    """A dataset the trainer refuses before training starts; the message names the file and why."""


class NoSignal(DatasetError):
    """A whole, well-formed dataset with nothing to learn: every group's rewards are equal (or no
    group has two episodes). The loop ends the cycle without a checkpoint."""


@dataclass
class Minibatch:
    """Right-padded, (B, T) for inputs, (B, T-1) for per-token targets (entry t is token t+1)."""

    input_ids: torch.Tensor  # (B, T) int64
    attention_mask: torch.Tensor  # (B, T) int64, 1 on real tokens
    loss_mask: torch.Tensor  # (B, T-1) float, 1 on tokens the policy sampled
    behaviour_logprobs: torch.Tensor  # (B, T-1) float, the served policy's logprob where loss_mask
    advantages: torch.Tensor  # (B, T-1) float, verl's estimator, 0 off loss_mask
    rows: torch.Tensor  # (B,) which episodes (indexes into Episodes)
    # (first row, end row, shared prefix length) runs covering the rows: the rows of a run begin
    # with the same tokens (a GRPO group's prompt), which the forward computes once; 0: no sharing
    runs: tuple[tuple[int, int, int], ...] = ()
    # (B, T-1) float, the temperature token t+1 was sampled at (1 off loss_mask); None: all 1.
    # The trainer's logits are divided by it, so its logprobs are of the distribution that sampled
    temperatures: torch.Tensor | None = None

    @property
    def tokens(self) -> int:
        return int(self.loss_mask.sum())

    def to(self, device: str | torch.device) -> "Minibatch":
        return Minibatch(*(t.to(device) for t in (self.input_ids, self.attention_mask, self.loss_mask,
                                                  self.behaviour_logprobs, self.advantages)), self.rows, self.runs,
                         None if self.temperatures is None else self.temperatures.to(device))


@dataclass
class Episodes:
    """The train split, one entry per trainable episode."""

    input_ids: list[torch.Tensor]  # (n_i,) int64 each
    loss_mask: list[torch.Tensor]  # (n_i - 1,)
    behaviour_logprobs: list[torch.Tensor]  # (n_i - 1,)
    advantages: list[torch.Tensor]  # (n_i - 1,)
    rewards: torch.Tensor  # (N,)
    group_ids: list[str]
    counts: dict[str, int]  # episodes/groups kept and left out, by reason
    temperatures: list[torch.Tensor] | None = None  # (n_i - 1,): token t+1's sampling temperature
    estimator: str = "grpo"  # verl's advantage estimator the advantages came from
    estimator_reason: str = ""  # why (trainer.adv_estimator, or what `auto` saw in the data)

    def __len__(self) -> int:
        return len(self.input_ids)

    def minibatch(self, rows: list[int] | torch.Tensor, pad_id: int = 0, width: int | None = None,
                  share_prefix: int | None = None) -> Minibatch:
        """`rows` padded on the right to `width` tokens (default: the longest of them). With
        `share_prefix`, neighbouring rows of one group whose common prefix is at least that many
        tokens form a run the forward computes the prefix of once (`runs`)."""
        rows = torch.as_tensor(rows, dtype=torch.long)
        n = width or max(int(self.input_ids[i].numel()) for i in rows)
        b = len(rows)
        ids = torch.full((b, n), pad_id, dtype=torch.long)
        att = torch.zeros((b, n), dtype=torch.long)
        mask, blp, adv = (torch.zeros((b, n - 1)) for _ in range(3))
        temps = torch.ones((b, n - 1))
        for j, i in enumerate(rows.tolist()):
            k = self.input_ids[i].numel()
            ids[j, :k], att[j, :k] = self.input_ids[i], 1
            mask[j, :k - 1], blp[j, :k - 1], adv[j, :k - 1] = (self.loss_mask[i], self.behaviour_logprobs[i],
                                                               self.advantages[i])
            if self.temperatures is not None:
                temps[j, :k - 1] = self.temperatures[i]
        runs = self.prefix_runs(rows.tolist(), share_prefix) if share_prefix is not None else ()
        return Minibatch(ids, att, mask, blp, adv, rows, runs, temps if self.temperatures is not None else None)

    def prefix_runs(self, rows: list[int], min_prefix: int) -> tuple[tuple[int, int, int], ...]:
        """(start, end, prefix) over `rows`: maximal stretches of one group, each with the length
        of its rows' common prefix, or 0 where that is under `min_prefix` tokens or the stretch is
        one row. Neighbouring stretches with prefix 0 are one run (one batched forward), which
        shares what all its rows begin with where that is `min_prefix` tokens or more: ungrouped
        traffic, all singletons, is one forward per step whose system prompt and tools are computed
        once (bench/train_step.py on a traffic dataset). A prefix is kept one token short of the
        run's shortest row, so every row has a token of its own."""
        runs, start = [], 0
        for j in range(1, len(rows) + 1):
            if j < len(rows) and self.group_ids[rows[j]] == self.group_ids[rows[start]]:
                continue
            prefix = self._common_prefix(rows[start:j]) if j - start > 1 else 0
            prefix = prefix if prefix >= min_prefix else 0
            if prefix == 0 and runs and runs[-1][2] == 0:
                runs[-1] = (runs[-1][0], j, 0)
            else:
                runs.append((start, j, prefix))
            start = j
        for k, (s, e, p) in enumerate(runs):
            if p == 0 and e - s > 1 and (shared := self._common_prefix(rows[s:e])) >= min_prefix:
                runs[k] = (s, e, shared)  # a run of several groups: what all their rows begin with
        return tuple(runs)

    def _common_prefix(self, rows: list[int]) -> int:
        seqs = [self.input_ids[i] for i in rows]
        shortest = min(int(x.numel()) for x in seqs)
        same = torch.stack([x[:shortest] for x in seqs]).eq(seqs[0][:shortest]).all(dim=0)
        return min(int(same.int().cumprod(0).sum()), shortest - 1)


def check_dataset(path: str | Path) -> RLDatasetManifest:
    """The manifest of the dataset at `path`, once every file in it is there, whole and of the schema."""
    path = Path(path)
    try:
        manifest = load_manifest(path)
    except FileNotFoundError:
        raise DatasetError(f"{path}: not an RL dataset (no manifest; an interrupted build leaves none)") from None
    except (ValueError, KeyError, TypeError) as e:
        raise DatasetError(f"{path}: unreadable dataset manifest: {e}") from None
    for rel, digest in sorted(manifest.files.items()):
        f = path / rel
        if not f.is_file():
            raise DatasetError(f"{f}: listed in the dataset manifest but missing")
        if file_sha256(f) != digest:
            raise DatasetError(f"{f}: sha256 differs from the dataset manifest (truncated or replaced)")
        try:
            schema = pq.read_schema(f)
        except (pa.ArrowInvalid, OSError) as e:
            raise DatasetError(f"{f}: not a readable Parquet file: {e}") from None
        want = {n: DATASET_SCHEMA.field(n).type for n in COLUMNS}
        have = {n: schema.field(n).type for n in COLUMNS if n in schema.names}
        bad = {n: f"{have.get(n, 'missing')} (want {t})" for n, t in want.items() if have.get(n) != t}
        if bad:
            raise DatasetError(f"{f}: schema differs from DATASET_SCHEMA: {bad}")
    return replace(manifest, path=str(path))  # where it is now (a dataset folder can be moved)


GROUP_BASELINE = ("grpo", "rloo", "opo")  # need every episode in a group of >= min_group_size
UNGROUPED = ("reinforce_plus_plus", "reinforce_plus_plus_baseline")  # singletons are training data


def resolve_estimator(requested: str, group_sizes: list[int], min_group_size: int = 2) -> tuple[str, str]:
    """(verl estimator name, why) for data whose groups have `group_sizes` episodes each."""
    if requested != "auto":
        return requested, "set in trainer.adv_estimator"
    grouped = sum(1 for n in group_sizes if n >= min_group_size)
    if grouped == len(group_sizes):
        return "grpo", f"auto: all {grouped} groups have >= {min_group_size} episodes"
    if grouped == 0:
        return "reinforce_plus_plus", f"auto: no group has {min_group_size} episodes ({len(group_sizes)} singletons or small)"
    return "reinforce_plus_plus_baseline", (f"auto: {grouped} groups of >= {min_group_size} episodes beside "
                                            f"{len(group_sizes) - grouped} smaller ones")


def _advantages(name: str, token_rewards: torch.Tensor, mask: torch.Tensor, index: np.ndarray,
                norm_adv_by_std: bool) -> torch.Tensor:
    from verl.trainer.config.algorithm import AlgoConfig
    from verl.trainer.ppo.core_algos import get_adv_estimator_fn

    fn = get_adv_estimator_fn(name)
    if name == "grpo":
        return fn(token_level_rewards=token_rewards, response_mask=mask, index=index,
                  norm_adv_by_std_in_grpo=norm_adv_by_std)[0]
    config = AlgoConfig(gamma=1.0, norm_adv_by_std_in_grpo=norm_adv_by_std)
    if name == "reinforce_plus_plus":
        return fn(token_level_rewards=token_rewards, response_mask=mask, config=config)[0]
    return fn(token_level_rewards=token_rewards, response_mask=mask, index=index, config=config)[0]


def load_episodes(manifest: RLDatasetManifest, adv_estimator: str = "grpo", norm_adv_by_std: bool = True,
                  min_group_size: int = 2, split: str = "train") -> Episodes:
    """Read `split` of a checked dataset and compute its advantages with verl's estimator
    (`auto`: chosen from the data, `resolve_estimator`; the choice is in the result)."""

    files = manifest.files_of(split)
    tables = [pq.read_table(f, columns=[c for c in (*COLUMNS, *SEGMENT_COLUMNS) if c in pq.read_schema(f).names])
              for f in files]
    rows = [r for t in tables for r in t.to_pylist()]
    want = manifest.train_episodes if split == "train" else manifest.heldout_episodes
    if not files or len(rows) != want:
        raise DatasetError(f"{manifest.path}: {split} holds {len(rows)} episodes, the manifest says {want}")
    for r in rows:
        n = len(r["input_ids"])
        if not (len(r["assistant_mask"]) == len(r["behaviour_logprobs"]) == len(r["weight_versions"])
                == len(r["temperatures"]) == n >= 2):
            raise DatasetError(f"{manifest.path}: episode {r['episode_id']}: per-token lists of different lengths")
    # an episode a client re-tokenized is several rows (segments, datasets built before: one): groups,
    # signal and advantages are the episode's, from its last segment; every segment trains with them
    segments_of: dict[str, list[dict]] = {}
    for r in rows:
        segments_of.setdefault(r["episode_id"], []).append(r)
    rows = [r for r in rows if (r.get("segment") or 0) == (r.get("segments") or 1) - 1]
    sizes = Counter(r["group_id"] for r in rows)
    estimator, why = resolve_estimator(adv_estimator, list(sizes.values()), min_group_size)
    counts = Counter()
    keep = []
    for r in rows:
        if estimator in GROUP_BASELINE and sizes[r["group_id"]] < min_group_size:
            counts["episodes_in_small_groups"] += 1
        elif not any(r["assistant_mask"][1:]):
            counts["episodes_without_sampled_tokens"] += 1
        else:
            keep.append(r)
    by_group: dict[str, list] = {}
    for r in keep:
        by_group.setdefault(r["group_id"], []).append(float(r["reward"]))
    flat = {g for g, v in by_group.items() if len(v) > 1 and len(set(v)) == 1}  # no signal against its mean
    if len({float(r["reward"]) for r in keep}) < 2:
        flat = set(by_group)  # one reward for the whole batch: nothing to learn under any estimator
    signal_rows = [r for r in keep if r["group_id"] not in flat]
    counts.update(episodes_read=len(rows), groups_read=len(sizes), groups_all_equal_reward=len(flat),
                  episodes_all_equal_reward=len(keep) - len(signal_rows), episodes=len(signal_rows),
                  groups=len(by_group) - len(flat),
                  singletons=sum(1 for g, v in by_group.items() if len(v) == 1 and g not in flat))
    if not keep:
        raise NoSignal(f"{manifest.path}: no trainable episodes in {split} ({dict(counts)})")
    if not signal_rows:
        raise NoSignal(f"{manifest.path}: every group's rewards are all equal: nothing to learn ({dict(counts)})")

    n = max(len(r["input_ids"]) for r in signal_rows) - 1
    mask = torch.zeros((len(signal_rows), n))
    rewards = torch.tensor([float(r["reward"]) for r in signal_rows])
    for i, r in enumerate(signal_rows):
        mask[i, :len(r["input_ids"]) - 1] = torch.tensor(r["assistant_mask"][1:], dtype=torch.float32)
    token_rewards = torch.zeros_like(mask)
    last = (mask * torch.arange(n)).argmax(dim=1)  # the outcome reward sits on the last sampled token
    token_rewards[torch.arange(len(signal_rows)), last] = rewards
    index = np.array([r["group_id"] for r in signal_rows], dtype=object)
    adv = _advantages(estimator, token_rewards, mask, index, norm_adv_by_std)
    lengths = [len(r["input_ids"]) - 1 for r in signal_rows]
    ep, ep_mask, ep_adv, ep_reward = [], [], [], []
    for i, r in enumerate(signal_rows):
        for seg in sorted(segments_of[r["episode_id"]], key=lambda s: s.get("segment") or 0):  # the last: `r`
            if seg is r:
                ep_mask.append(mask[i, :lengths[i]].clone())
                ep_adv.append(adv[i, :lengths[i]].clone())
            else:  # the episode's (outcome) advantage on this segment's own sampled tokens
                m = torch.tensor(seg["assistant_mask"][1:], dtype=torch.float32)
                ep_mask.append(m)
                ep_adv.append(adv[i, last[i]] * m)
            ep.append(seg)
            ep_reward.append(float(r["reward"]))
    counts["segment_rows"] = len(ep) - len(signal_rows)
    return Episodes(
        input_ids=[torch.tensor(r["input_ids"], dtype=torch.long) for r in ep],
        loss_mask=ep_mask,
        behaviour_logprobs=[torch.tensor(r["behaviour_logprobs"][1:], dtype=torch.float32) for r in ep],
        advantages=ep_adv,
        rewards=torch.tensor(ep_reward), group_ids=[r["group_id"] for r in ep], counts=dict(counts),
        temperatures=[torch.tensor(r["temperatures"][1:], dtype=torch.float32) for r in ep],
        estimator=estimator, estimator_reason=why)
