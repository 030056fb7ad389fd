"""A model family and an expert tier are each one module: added from outside the package, they load, quantize,
plan and run with no other file changed; and no family's name appears outside models/ and testing/."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from vismmoe_edge.models import registry

PACKAGE = Path(__file__).resolve().parents[1] / "vismmoe_edge"
FAMILY_NAMES = re.compile(r"qwen3_vl_moe|deepseek_vl_v2|glm4v_moe")

THROWAWAY_FAMILY = '''
"""A family this package does not know: Qwen3-VL-MoE's classes under another model_type."""
import dataclasses
from pathlib import Path

from transformers import Qwen3VLMoeConfig

from vismmoe_edge.config_json import read_config_json
from vismmoe_edge.errors import VismmoeError
from vismmoe_edge.models import qwen3_vl_moe

MODEL_TYPE = "throwaway_vlmoe"


def read_config(directory: Path) -> Qwen3VLMoeConfig:
    raw = read_config_json(directory)
    if raw.get("model_type") != MODEL_TYPE:
        raise VismmoeError(f"{directory}: not a {MODEL_TYPE} checkpoint")
    return Qwen3VLMoeConfig.from_dict(raw)


FAMILY = dataclasses.replace(
    qwen3_vl_moe.FAMILY, model_type=MODEL_TYPE, architecture="ThrowawayVLMoe", read_config=read_config
)
'''


def test_family_names_appear_only_in_models_and_testing() -> None:
    found = [
        f"{p.relative_to(PACKAGE.parent)}: {m.group(0)}"
        for p in PACKAGE.rglob("*.py")
        if p.relative_to(PACKAGE).parts[0] not in ("models", "testing")
        for m in FAMILY_NAMES.finditer(p.read_text())
    ]
    assert found == []


@pytest.fixture
def throwaway_checkpoint(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[Path, Path]:
    """(a tiny checkpoint whose config.json names the throwaway family, the same weights as Qwen3-VL-MoE)."""
    from vismmoe_edge.testing.tiny_qwen3_vl_moe import build_tiny_checkpoint

    (tmp_path / "throwaway_family.py").write_text(THROWAWAY_FAMILY)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(registry, "FAMILIES", dict(registry.FAMILIES))
    registry.register_family("throwaway_vlmoe", "ThrowawayVLMoe", "throwaway_family")
    reference = build_tiny_checkpoint(tmp_path / "reference", seed=3, num_layers=2)
    ours = tmp_path / "ours"
    ours.mkdir()
    for f in reference.iterdir():
        (ours / f.name).write_bytes(f.read_bytes())
    config = json.loads((ours / "config.json").read_text())
    (ours / "config.json").write_text(
        json.dumps(config | {"model_type": "throwaway_vlmoe", "architectures": ["ThrowawayVLMoe"]})
    )
    return ours, reference


def test_a_family_from_a_test_module_loads_quantizes_and_plans(throwaway_checkpoint: tuple[Path, Path]) -> None:
    from vismmoe_edge.conversion import quantize_checkpoint, read_quantized_catalogue
    from vismmoe_edge.hardware.profiles import get_profile
    from vismmoe_edge.loader import load
    from vismmoe_edge.planning.plan import make_plan
    from vismmoe_edge.sampling import SamplingConfig

    ours, reference = throwaway_checkpoint
    assert registry.model_family(ours).model_type == "throwaway_vlmoe"
    sampling = SamplingConfig(max_new_tokens=4)
    got = load(ours, device="cpu", memory_budget="50%").generate("Hello", sampling=sampling).token_ids
    want = load(reference, device="cpu", memory_budget="50%").generate("Hello", sampling=sampling).token_ids
    assert got == want and len(got) == 4

    quantized = quantize_checkpoint(ours, ours.parent / "int8", 8, progress=False)
    catalogue = read_quantized_catalogue(quantized)
    assert catalogue.spec.quant.bits == 8 and len(catalogue.experts) == 2 * catalogue.num_experts

    plan = make_plan(ours, get_profile("cpu"), mem_available=2**30, c_safe=0, cgroup=None)
    assert plan.moe_layers == 2 and plan.memory_budget_bytes > 0 and plan.tier == "unified"


THROWAWAY_TIER = '''
"""A tier this package does not know: every fetch a fresh copy from the store, counted."""
from vismmoe_edge.experts.pipeline import TierDefaults

CALLS = {"fetch": 0, "after_load": 0}


class CountingTier(TierDefaults):
    name = "throwaway"

    def __init__(self, store, slots):
        self.store = store
        self.slot_bytes = store.expert_nbytes()

    def fetch(self, key, slot):
        CALLS["fetch"] += 1
        return self.store.load(*key)

    def read_bytes(self, key):
        return self.slot_bytes

    def ready(self, key, slot):
        pass

    def done(self, key, slot):
        pass

    def release(self, key, slot):
        pass

    def after_load(self, files, table, catalogue, pinned_layers):
        CALLS["after_load"] += 1


def make(store, slots, *, pinned=0, mirror=None):
    return CountingTier(store, slots)
'''


def test_a_tier_from_a_test_module_is_selected_with_tier(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, checkpoints: dict[str, Path]
) -> None:
    import importlib

    from typer.testing import CliRunner

    from vismmoe_edge.cli import app
    from vismmoe_edge.experts.tiers import registry as tiers

    (tmp_path / "throwaway_tier.py").write_text(THROWAWAY_TIER)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(tiers, "TIERS", dict(tiers.TIERS))
    tiers.register(tiers.TierKind("throwaway", "a fresh copy per fetch", "throwaway_tier", "host"))
    calls = importlib.import_module("throwaway_tier").CALLS

    argv = ["run", "--model", str(checkpoints["v5"]), "--prompt", "Hello", "--max-new-tokens", "3", "--device", "cpu",
            "--memory-budget", "30%", "--pinned-layers", "0", "--tier", "throwaway", "--json"]  # fmt: skip
    result = CliRunner().invoke(app, argv)
    assert result.exit_code == 0, result.output
    assert json.loads(result.output.strip().splitlines()[-1])["token_ids"]
    assert calls["fetch"] > 0 and calls["after_load"] == 1
    assert "throwaway (a fresh copy per fetch)" in tiers.tier_help()
