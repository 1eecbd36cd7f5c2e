"""The RL trainer's config: one dataclass, checked when built (the loop's `trainer:` section).

Defaults come from the measured GRPO probe on a model like the default one: AdamW lr 5e-5,
betas (0.9, 0.98), no weight decay, grad clip 1.0, clip 0.2 (lr 3e-4 collapsed at once).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

# verl's outcome-reward estimators: group baselines (grpo, rloo, opo), and two that train on
# ungrouped traffic; "auto" picks from the data (trainers/rl/data.py resolve_estimator)
ADV_ESTIMATORS = ("auto", "grpo", "rloo", "opo", "reinforce_plus_plus", "reinforce_plus_plus_baseline")
POLICY_LOSSES = ("vanilla", "gspo", "gpg", "cispo", "geo_mean", "dppo_tv")
LOSS_AGG_MODES = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum")
KL_TYPES = ("kl", "abs", "mse", "low_var_kl")


@dataclass
class RLConfig:
    # optimisation
    lr: float = 5e-5
    betas: tuple[float, float] = (0.9, 0.98)
    weight_decay: float = 0.0
    warmup_steps: int = 2
    lr_schedule: Literal["constant", "cosine"] = "cosine"
    grad_clip: float = 1.0
    epochs: int = 4  # passes over the train split
    minibatch_episodes: int = 64  # episodes per optimizer step, across all workers
    max_steps: int | None = None  # stop early after this many optimizer steps
    dtype: Literal["float32", "bfloat16"] = "float32"  # the trained (latent) weights and the forward
    # rows of a group that travel together in a minibatch, their common prompt computed once
    # (a KV cache the rows attend to); 1: episodes shuffled one by one, every prompt computed
    prefix_rows: int = 4
    seed: int = 0  # model-independent: shuffling and anything random in the step
    # algorithm: verl's core_algos, by name
    adv_estimator: str = "auto"  # grouped data: grpo; singletons: reinforce_plus_plus; both: its baseline form
    norm_adv_by_std: bool = True  # False: Dr. GRPO
    min_group_size: int = 2  # a group of one has no baseline: counted, not trained on
    policy_loss: str = "vanilla"  # PPO clip, dual-clip at clip_ratio_c
    clip_ratio: float = 0.2
    clip_ratio_c: float = 3.0
    loss_agg_mode: str = "token-mean"
    entropy_coeff: float = 0.0
    # rollout correction (verl's truncated importance sampling): the data was sampled by the served,
    # quantized, possibly older policy; tokens are reweighted by min(pi_prox / pi_behaviour, threshold)
    rollout_is: Literal["token", "sequence"] | None = "token"
    rollout_is_threshold: float = 2.0
    # KL to the parent checkpoint: off. The data is one version off-policy and every update is
    # clipped against the proximal policy; a reference costs a second forward pass per step
    # (~+30% time) and the probe learned without it. Turn it on for long multi-cycle runs.
    kl_coef: float = 0.0
    # The PPO "old" policy each token's ratio is clipped against: "job_start" (the parent's logprobs,
    # one no-grad forward over the train split before the first step: every epoch clipped against
    # the policy that sampled) or "previous_visit" (the episode's logprobs at its last visit, epoch
    # e-1: no extra forward, but over E epochs the policy can move ~(1 + clip)^E from its start).
    # Measured on the default loop (success on never-gated problems, 3 sampling seeds): job_start
    # +21.0 and +15.5 (7 cycles), +16.3 (10 cycles), mean drift KL per cycle 0.010, 0.019, 0.026,
    # 1.6 s more per train phase (5%); previous_visit +16.5 (7 cycles), drift KL 0.035. Efficacy:
    # within run-to-run noise; drift: lower in every run
    proximal: Literal["previous_visit", "job_start"] = "job_start"
    kl_type: str = "low_var_kl"
    # quantization-aware training with the serving format's spec (the loop passes it)
    qat: bool = True
    # data parallelism (Ray Train TorchTrainer; 0 runs the same loop in this process)
    num_workers: int = 1
    use_gpu: bool = False
    threads_per_worker: int | None = None  # torch threads per worker; None: the cores / workers
    # where the workers go (Ray's placement strategies): PACK fills a node first; SPREAD and
    # STRICT_SPREAD (one worker per node, or the job waits for nodes) spread them over a cluster
    placement: Literal["PACK", "SPREAD", "STRICT_SPREAD"] = "PACK"
    progress: bool = True

    def __post_init__(self):
        self.betas = tuple(self.betas)
        if not 0 < self.lr < 1:
            raise ValueError(f"lr must be in (0, 1), got {self.lr!r}")
        if len(self.betas) != 2 or not all(0 <= b < 1 for b in self.betas):
            raise ValueError(f"betas must be two numbers in [0, 1), got {self.betas!r}")
        for name in ("epochs", "minibatch_episodes", "min_group_size", "prefix_rows"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{name} must be an int >= 1, got {v!r}")
        for name in ("warmup_steps", "num_workers"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise ValueError(f"{name} must be an int >= 0, got {v!r}")
        if self.max_steps is not None and (isinstance(self.max_steps, bool) or not isinstance(self.max_steps, int)
                                           or self.max_steps < 1):
            raise ValueError(f"max_steps must be an int >= 1 or null, got {self.max_steps!r}")
        if self.proximal not in ("previous_visit", "job_start"):
            raise ValueError(f"proximal must be previous_visit or job_start, got {self.proximal!r}")
        if self.minibatch_episodes < max(1, self.num_workers):
            raise ValueError(f"minibatch_episodes {self.minibatch_episodes} < num_workers {self.num_workers}")
        if not self.grad_clip > 0:
            raise ValueError(f"grad_clip must be > 0, got {self.grad_clip!r}")
        if self.adv_estimator not in ADV_ESTIMATORS:
            raise ValueError(f"adv_estimator must be one of {ADV_ESTIMATORS}, got {self.adv_estimator!r}")
        if self.policy_loss not in POLICY_LOSSES:
            raise ValueError(f"policy_loss must be one of {POLICY_LOSSES}, got {self.policy_loss!r}")
        if self.loss_agg_mode not in LOSS_AGG_MODES:
            raise ValueError(f"loss_agg_mode must be one of {LOSS_AGG_MODES}, got {self.loss_agg_mode!r}")
        if self.kl_type not in KL_TYPES:
            raise ValueError(f"kl_type must be one of {KL_TYPES}, got {self.kl_type!r}")
        if not 0 < self.clip_ratio < 1:
            raise ValueError(f"clip_ratio must be in (0, 1), got {self.clip_ratio!r}")
        if not self.clip_ratio_c > 1:
            raise ValueError(f"clip_ratio_c must be > 1 (dual-clip bound), got {self.clip_ratio_c!r}")
        if not self.rollout_is_threshold > 1:
            raise ValueError(f"rollout_is_threshold must be > 1, got {self.rollout_is_threshold!r}")
        if self.kl_coef < 0 or self.entropy_coeff < 0 or self.weight_decay < 0:
            raise ValueError("kl_coef, entropy_coeff and weight_decay must be >= 0")
        if self.use_gpu and self.num_workers == 0:
            raise ValueError("use_gpu needs num_workers >= 1 (the GPU workers run under Ray)")
        if self.placement not in ("PACK", "SPREAD", "STRICT_SPREAD"):
            raise ValueError(f"placement must be PACK, SPREAD or STRICT_SPREAD, got {self.placement!r}")
        if self.threads_per_worker is not None and self.threads_per_worker < 1:
            raise ValueError(f"threads_per_worker must be >= 1 or null, got {self.threads_per_worker!r}")
