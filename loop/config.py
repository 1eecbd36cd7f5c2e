"""The loop's config: one dataclass per component, composed here and nowhere else.

`conf/*.yaml` files override these embedded defaults; `loop.configs.load` checks every key.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from loop.bootstrap import BootstrapConfig, TaskConfig
from loop.collect import CollectConfig, DatasetPhaseConfig
from loop.configs import load
from loop.learner import TRAIN_FROM
from pipelines.promote import PromoteConfig
from pipelines.requantize import RequantizeConfig
from pipelines.speculator import SpeculatorConfig
from pipelines.validate import GateConfig
from rollout.engine import EngineConfig
from rollout.server.config import ServeConfig
from trainers.rl.config import RLConfig
from trainers.rl.launch import RayConfig


@dataclass
class MlflowConfig:
    # None: a sqlite store under run_dir (sqlite:///<run_dir>/mlflow.db); a team's server:
    # http://host:5000 (infra/mlflow/server.sh: PostgreSQL, artifacts proxied by the server)
    tracking_uri: str | None = None
    experiment: str = "flywheel"
    # a tracking server that does not answer: each request retried this many times (backoff 2, 4, 8 ...
    # s), each attempt at most http_timeout_s; then the loop stops, said why, and resumes when rerun
    http_retries: int = 5
    http_timeout_s: int = 60

    def __post_init__(self):
        from urllib.parse import urlsplit

        for name in ("http_retries", "http_timeout_s"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < (0 if name == "http_retries" else 1):
                raise ValueError(f"{name} must be an int >= {0 if name == 'http_retries' else 1}, got {v!r}")

        if self.tracking_uri and urlsplit(self.tracking_uri).password:
            raise ValueError("tracking_uri holds a password, which would be logged with the config; give the "
                             "URI without it and the credentials in MLFLOW_TRACKING_USERNAME / "
                             "MLFLOW_TRACKING_PASSWORD (MLflow reads them from the environment)")


@dataclass
class BaseConfig:
    # A local Hugging Face causal-LM folder (an architecture vLLM serves, a chat template with tool
    # calls) trained and served instead of the model the bootstrap builds; null: the bootstrap's
    model: str | None = None

    def __post_init__(self):
        if self.model is not None:
            from rollout.engine import check_servable

            try:
                check_servable(self.model)
            except ValueError as e:
                raise ValueError(f"model: {e}") from None


@dataclass
class CycleConfig:
    cycles: int = 3  # cycles per `loop run`
    problem_seed_stride: int = 1  # cycle k collects collect.problem_seed + (k-1)*stride: fresh problems
    # what a cycle trains: "serving" (the weights serving now), or "learner" (a candidate the gate
    # rejected only for want of proof keeps training; loop/learner.py)
    train_from: str = "serving"

    def __post_init__(self):
        if isinstance(self.cycles, bool) or not isinstance(self.cycles, int) or self.cycles < 1:
            raise ValueError(f"cycles must be an int >= 1, got {self.cycles!r}")
        if self.train_from not in TRAIN_FROM:
            raise ValueError(f"train_from must be one of {TRAIN_FROM}, got {self.train_from!r}")


@dataclass
class LoopConfig:
    run_dir: str = "runs/agent_rl"
    base: BaseConfig = field(default_factory=BaseConfig)
    loop: CycleConfig = field(default_factory=CycleConfig)
    task: TaskConfig = field(default_factory=TaskConfig)
    bootstrap: BootstrapConfig = field(default_factory=BootstrapConfig)
    engine: EngineConfig = field(default_factory=EngineConfig)
    mlflow: MlflowConfig = field(default_factory=MlflowConfig)
    serve: ServeConfig = field(default_factory=ServeConfig)
    collect: CollectConfig = field(default_factory=CollectConfig)
    dataset: DatasetPhaseConfig = field(default_factory=DatasetPhaseConfig)
    trainer: RLConfig = field(default_factory=RLConfig)
    ray: RayConfig = field(default_factory=RayConfig)
    requantize: RequantizeConfig = field(default_factory=RequantizeConfig)
    validate: GateConfig = field(default_factory=GateConfig)
    promote: PromoteConfig = field(default_factory=PromoteConfig)
    speculator: SpeculatorConfig = field(default_factory=SpeculatorConfig)

    def __post_init__(self):
        if not self.run_dir:
            raise ValueError("run_dir must not be empty")
        if self.base.model is not None:
            self.use_base_model()
        if self.serve.trace_root == ServeConfig.trace_root:  # not set: the run's own, beside its datasets
            self.serve.trace_root = str(Path(self.run_dir) / "data")
        if self.serve.weights_roots is None:  # what the loop writes and serves: its own folders, the base
            run = Path(self.run_dir).resolve()
            self.serve.weights_roots = [str(run / d) for d in ("served", "checkpoints", "drafts")] + [
                str(Path(self.bootstrap.cache_dir).resolve())]

    def use_base_model(self) -> None:
        """base.model stands in for the bootstrap; its template must name a tool parser the
        task's tool calls can be read with (serve.tool_call_parser)."""
        from rollout.server.config import resolve_tool_parser

        if self.bootstrap.model.path not in (None, self.base.model):
            raise ValueError(f"base.model {self.base.model} and bootstrap.model.path {self.bootstrap.model.path} "
                             "differ: set base.model only")
        parser = resolve_tool_parser(self.serve, self.base.model)
        if parser is None and self.task.agent is None:
            raise ValueError(f"serve.tool_call_parser none: the {self.task.name} task calls tools, so the model "
                             "must serve tool calls")
        self.bootstrap.model.path = self.base.model

    @property
    def tracking_uri(self) -> str:
        if self.mlflow.tracking_uri:
            return self.mlflow.tracking_uri
        return f"sqlite:///{(Path(self.run_dir) / 'mlflow.db').resolve()}"


def load_config(path: str | Path, overrides: list[str] = ()) -> LoopConfig:
    return load(LoopConfig, path, overrides)
