"""Golden files: every child of each scenario, rendered. Regenerate with `make golden`."""

import os

import pytest
import yaml
from omnistage.api import DEFAULT_ENGINE_IMAGE, KIND, POOL_KIND
from omnistage.cli import runnable_pools
from omnistage.render import render_children, target_from
from omnistage.yamlio import dump_all

from tests.support.repo import ROOT

SCENARIOS = sorted(p.stem for p in (ROOT / "tests/unit/scenarios").glob("*.yaml"))
GOLDEN = ROOT / "tests/unit/golden"
TOKEN, HEAD_IP, HEAD_UID = "golden-token", "127.77.0.10", "00000000-0000-0000-0000-00000000beef"


def render_scenario(name: str) -> str:
    docs = list(yaml.safe_load_all((ROOT / f"tests/unit/scenarios/{name}.yaml").read_text()))
    [obj] = [d for d in docs if d["kind"] == KIND]
    t = target_from(obj, default_image=DEFAULT_ENGINE_IMAGE)
    pools = runnable_pools(t, [d for d in docs if d["kind"] == POOL_KIND])
    header = f"# scenario {name}: effective cache mode {t.cache.mode} ({t.cache.reason})\n"
    return header + dump_all(render_children(t, TOKEN, HEAD_IP, HEAD_UID, pools).all())


def test_all_scenarios_present():
    assert set(SCENARIOS) >= {"static-single", "two-replicas", "dynamic-one", "cache-disabled", "text-only",
                              "custom-placement", "pod-template", "speech-network", "speech-same-node"}


@pytest.mark.parametrize("name", SCENARIOS)
def test_golden(name):
    path = GOLDEN / f"{name}.yaml"
    got = render_scenario(name)
    if os.environ.get("OMNISTAGE_UPDATE_GOLDEN") == "1":
        path.write_text(got)
    assert path.exists(), f"no golden file for {name}: run `make golden`"
    assert got == path.read_text(), f"rendering of {name} changed: review, then `make golden`"
