"""Build the base agent model here, with no hub: tokenizer -> model -> SFT -> save -> evaluate.

The result is a Hugging Face folder (config.json, model.safetensors, tokenizer files, chat
template) plus `flywheel_manifest.json`. It is cached under `cache_dir/base-<key>`, where the key
hashes everything that shapes it (model shape, SFT settings, task seeds), and written atomically
(built in a temporary folder, then renamed), so an interrupted bootstrap leaves nothing half-made
and a second run reuses the first.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from rollout.artifacts import MANIFEST, building, file_sha256
from trainers.bootstrap.model import ModelConfig
from trainers.bootstrap.sft import SFTConfig



@dataclass
class TaskConfig:
    # the task the loop's own collector plays, scores, evaluates and bootstraps from (rollout/tasks):
    # calculator | sql | "package.module:attribute" (an object shaped as rollout.tasks.Task)
    name: str = "calculator"
    seed: int = 0
    num_eval_problems: int = 200  # the eval split used for base success (and later, RL evals)
    # Your agent on your tasks (rollout/agents.py): "module:function" or "file.py:function", an async
    # function (task: dict, client) -> reward | None; the collector plays source's train split through
    # it. None: the loop's collector plays `name`. With an agent the gate decides by OPE on the logged
    # held-out episodes (validate.success_source auto).
    agent: str | None = None
    source: str | None = None  # tasks: a folder of train/eval .jsonl|.parquet, a saved DatasetDict, or one file

    def __post_init__(self):
        try:
            self.load()
        except ValueError as e:
            raise ValueError(f"name: {e}") from None
        if self.num_eval_problems <= 0:
            raise ValueError(f"num_eval_problems must be positive, got {self.num_eval_problems}")
        if (self.agent is None) != (self.source is None):
            raise ValueError("agent and source go together: your agent plays the tasks of source")
        if self.agent is not None:
            from rollout.agents import load_agent
            from rollout.task_source import load_tasks

            load_agent(self.agent)
            if not load_tasks(self.source, "train"):
                raise ValueError(f"source {self.source}: the train split holds no task")

    def load(self):
        """The task object `name` names (rollout.tasks.load_task)."""
        from rollout.tasks import load_task

        return load_task(self.name)


@dataclass
class BootstrapConfig:
    cache_dir: str = ".cache/flywheel"
    model: ModelConfig = field(default_factory=ModelConfig)
    sft: SFTConfig = field(default_factory=SFTConfig)
    tokenizer_corpus_problems: int = 3000


@dataclass
class BaseModelManifest:
    kind: str
    path: str
    key: str
    num_parameters: int
    sft_steps: int
    sft_seconds: float
    sft_eval_success: float
    files_sha256: dict[str, str]
    config: dict
    created_at: float
    eval: dict = field(default_factory=dict)  # {"vllm_greedy": x, "vllm_t1": y, "num_problems": n}
    sft_history: list[dict] = field(default_factory=list)  # [{"step", "sft/loss", ...}]

    def save(self, folder: str | Path) -> None:
        tmp = Path(folder) / (MANIFEST + ".tmp")
        tmp.write_text(json.dumps(asdict(self), indent=2))
        tmp.replace(Path(folder) / MANIFEST)

    @classmethod
    def load(cls, folder: str | Path) -> "BaseModelManifest":
        """The manifest, its `path` the folder it was read from (a cache folder may have been moved)."""
        data = json.loads((Path(folder) / MANIFEST).read_text())
        return cls(**{**data, "path": str(Path(folder).resolve())})


def cache_key(cfg: BootstrapConfig, task: TaskConfig) -> str:
    model = asdict(cfg.model)
    if model["family"] == "qwen2":  # the bases built before families existed keep their keys
        del model["family"]
    sft = asdict(cfg.sft)
    if sft["lr_schedule"] == "constant":  # and those built before SFT had a schedule
        del sft["lr_schedule"]
    key = {"model": model, "sft": sft, "task_seed": task.seed,
           "corpus": cfg.tokenizer_corpus_problems, "format": 2}  # 2: templates render a tool's signature only
    if task.name != "calculator":  # and those built before tasks had names
        key["task"] = task.name
        if getattr(task.load(), "version", None):  # a task whose problems or demonstrations changed
            key["task_version"] = task.load().version
    blob = json.dumps(key, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:12]


def sha256_files(folder: Path) -> dict[str, str]:
    return {p.name: file_sha256(p)
            for p in sorted(folder.iterdir()) if p.is_file() and p.name != MANIFEST}


def bootstrap(cfg: BootstrapConfig, task: TaskConfig, log=lambda step, metrics: None) -> BaseModelManifest:
    """Return the cached base model for `cfg`, building it first if needed."""
    if cfg.model.path:
        folder = Path(cfg.model.path)
        if not (folder / "config.json").is_file():
            raise FileNotFoundError(f"model.path {folder} is not a Hugging Face folder (no config.json)")
        if (folder / MANIFEST).is_file():
            return BaseModelManifest.load(folder)
        return BaseModelManifest("external", str(folder), "", 0, 0, 0.0, float("nan"),
                                 sha256_files(folder), {}, time.time())
    key = cache_key(cfg, task)
    folder = Path(cfg.cache_dir).resolve() / f"base-{key}"
    if not (folder / MANIFEST).is_file():
        with building(folder):  # another loop, server or test session may be building the same key
            if not (folder / MANIFEST).is_file():
                _build(cfg, task, key, folder, log)
    return BaseModelManifest.load(folder)


def _build(cfg: BootstrapConfig, task: TaskConfig, key: str, folder: Path, log) -> None:
    """Train the tokenizer, build the model and SFT it on the task's demonstrations into `folder`."""
    import torch

    from rollout.chat import encode_demo
    from rollout.episode import hf_generate, run_episodes, success_rate
    from trainers.bootstrap.model import build_model
    from trainers.bootstrap.sft import sft
    from trainers.bootstrap.tokenizer import render_texts, save_hf_tokenizer, train_tokenizer

    torch.set_num_threads(max(1, torch.get_num_threads()))
    world = task.load()
    train = world.problems("train", max(cfg.sft.num_train_problems, cfg.tokenizer_corpus_problems), task.seed)
    evals = world.problems("eval", cfg.sft.eval_problems, task.seed + 1)  # SFT's early-stop slice
    tmp = folder.with_name(folder.name + f".tmp-{time.time_ns()}")
    tmp.mkdir(parents=True)
    try:
        family = cfg.model.family
        texts = render_texts([world.demonstration(p) for p in train[: cfg.tokenizer_corpus_problems]], world.tools,
                             family)
        tok = train_tokenizer(texts, cfg.model.vocab_size, family)
        tokenizer = save_hf_tokenizer(tok, tmp, cfg.model.max_position_embeddings, family)
        model = build_model(cfg.model, tokenizer, seed=cfg.sft.seed)

        def evaluate(m) -> float:  # the task's sampled success: what SFT stops on
            return success_rate(run_episodes(evals, tokenizer, hf_generate(m, tokenizer), task=world,
                                             temperature=cfg.sft.eval_temperature))

        demos = [world.demonstration(p) for p in train[: cfg.sft.num_train_problems]]
        encoded = [encode_demo(tokenizer, d, world.tools) for d in demos]  # in the model's own chat format
        result = sft(model, tokenizer, cfg.sft, encoded, evaluate, log=log)
        model.save_pretrained(str(tmp), safe_serialization=True)
        manifest = BaseModelManifest(
            kind="base_model", path=str(folder), key=key,
            num_parameters=sum(p.numel() for p in model.parameters()),
            sft_steps=result.steps, sft_seconds=round(result.seconds, 2),
            sft_eval_success=result.eval_success, files_sha256=sha256_files(tmp),
            config={"model": asdict(cfg.model), "sft": asdict(cfg.sft), "task": asdict(task)},
            created_at=time.time(), sft_history=result.history,
        )
        manifest.save(tmp)
        if folder.exists():  # a build that died before its manifest: ours replaces it
            shutil.rmtree(folder)
        tmp.rename(folder)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def evaluate_with_vllm(manifest: BaseModelManifest, task: TaskConfig, engine_cfg, llm=None) -> dict:
    """Base success on the eval split through the vLLM engine, greedy and at T=1.0; saved in the
    manifest. Pass a running `llm` to reuse an engine; one made here is shut down after (its
    engine-core process and memory would otherwise stay with `loop run` for all its cycles)."""
    from transformers import AutoTokenizer

    from loop.evaluate import eval_success
    from rollout.engine import make_llm

    own = llm is None
    llm = llm or make_llm(manifest.path, engine_cfg)
    tokenizer = AutoTokenizer.from_pretrained(manifest.path)
    result = {"num_problems": task.num_eval_problems}
    try:
        for name, temperature in (("vllm_greedy", 0.0), ("vllm_t1", 1.0)):
            t0 = time.perf_counter()
            result[name] = eval_success(llm, tokenizer, task, temperature)
            result[name + "_seconds"] = round(time.perf_counter() - t0, 2)
    finally:
        if own:
            llm.llm_engine.engine_core.shutdown()
    manifest.eval = result
    if Path(manifest.path, MANIFEST).is_file():
        manifest.save(manifest.path)
    return result
