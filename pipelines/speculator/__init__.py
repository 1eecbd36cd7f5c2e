"""Speculators trained on the traffic they serve: distill a draft from its target on recent traces,
with an offline estimate of its acceptance (what vLLM's draft-model speculation will accept)."""

from pipelines.speculator.acceptance import expected_acceptance
from pipelines.speculator.config import Acceptance, DraftShape, SpeculatorConfig, SpeculatorManifest
from pipelines.speculator.data import traffic_sequences
from pipelines.speculator.distill import distill, new_draft

__all__ = ["Acceptance", "DraftShape", "SpeculatorConfig", "SpeculatorManifest", "distill", "expected_acceptance",
           "new_draft", "traffic_sequences"]
