"""The environment the install recipe builds: the pinned stack imports, verl's algorithm functions
work beside vLLM's transformers, and no Flywheel package shadows a distribution others probe for."""

import importlib.metadata as md

import torch


def test_pinned_stack():
    import vllm

    assert torch.__version__.startswith("2.13.0")
    assert vllm.__version__.startswith("0.32")
    assert md.version("mlflow") == "3.17.2" and md.version("verl") == "0.9.1"


def test_verl_core_algos_compute_grpo_advantages():
    from verl.trainer.ppo.core_algos import compute_grpo_outcome_advantage

    rewards = torch.tensor([[0.0, 0.0, 1.0], [0.0, 0.0, 0.0], [0.0, 1.0, 0.0], [0.0, 0.0, 0.0]])
    mask = torch.ones_like(rewards)
    index = ["a", "a", "b", "b"]
    adv, _ = compute_grpo_outcome_advantage(rewards, mask, index=__import__("numpy").array(index))
    # within each group the rewarded episode gets a positive advantage, its sibling a negative one
    assert adv[0, 0] > 0 > adv[1, 0] and adv[2, 0] > 0 > adv[3, 0]


def test_flywheel_kernels_does_not_pass_for_huggingface_kernels():
    import kernels
    from transformers.utils.import_utils import is_kernels_available

    assert kernels.__file__.startswith(str(__import__("pathlib").Path(__file__).resolve().parents[1]))
    assert not is_kernels_available()


def test_no_broken_vision_wheels_beside_cpu_torch():
    import importlib.util

    for name in ("torchvision", "torchaudio", "torchcodec"):
        assert importlib.util.find_spec(name) is None, f"{name} is installed; scripts/setup.sh removes it"
    from transformers import Qwen2ForCausalLM  # noqa: F401  (fails when torchvision is broken)
