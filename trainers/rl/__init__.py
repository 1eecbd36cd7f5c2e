"""GRPO/PPO on verl's core_algos, with QAT, on Ray: `run_training(TrainJob(...), RayConfig())`."""

from trainers.rl.config import RLConfig
from trainers.rl.launch import RayConfig, run_training
from trainers.rl.manifest import PolicyCheckpoint, load_checkpoint
from trainers.rl.train import TrainJob

__all__ = ["RLConfig", "RayConfig", "TrainJob", "PolicyCheckpoint", "load_checkpoint", "run_training"]
