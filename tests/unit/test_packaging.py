"""Two distributions from one repository: the operator (pyproject.toml) and the vLLM plugin
(engine_patches/pyproject.toml). The engine image installs only the plugin; the operator pins the
plugin's exact version because both sides speak one contract (omnistage_engine_patches.contract)."""

from __future__ import annotations

import ast
import sys
import tomllib
from importlib import metadata
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
OPERATOR = tomllib.loads((ROOT / "pyproject.toml").read_text())
PLUGIN = tomllib.loads((ROOT / "engine_patches" / "pyproject.toml").read_text())


def test_operator_pins_the_plugin_version_it_ships_with():
    name, version = PLUGIN["project"]["name"], PLUGIN["project"]["version"]
    assert name == "omnistage-engine-patches"
    assert f"{name}=={version}" in OPERATOR["project"]["dependencies"]
    assert OPERATOR["project"]["version"] == version


def test_plugin_entry_points_live_in_the_plugin_distribution_only():
    assert "entry-points" not in OPERATOR["project"]
    eps = PLUGIN["project"]["entry-points"]
    assert eps["vllm.general_plugins"] == {"omnistage_engine_patches": "omnistage_engine_patches:apply"}
    assert eps["vllm.endpoint_plugins"] == {
        "omnistage_membership": "omnistage_engine_patches.membership_api:plugin"
    }
    # As installed (hack/setup.sh installs both editable): vLLM finds them under the plugin's name.
    found = {(ep.group, ep.name): ep.dist.name for group in ("vllm.general_plugins", "vllm.endpoint_plugins")
             for ep in metadata.entry_points(group=group) if ep.name.startswith("omnistage")}
    assert found == {("vllm.general_plugins", "omnistage_engine_patches"): "omnistage-engine-patches",
                     ("vllm.endpoint_plugins", "omnistage_membership"): "omnistage-engine-patches"}


def test_plugin_needs_nothing_outside_vllm_and_contract_needs_only_the_stdlib():
    assert PLUGIN["project"]["dependencies"] == []
    assert "kopf" not in str(PLUGIN) and "kubernetes" not in str(PLUGIN)
    # The operator image installs the plugin without its engine extra: contract.py must import
    # nothing but the standard library.
    tree = ast.parse((ROOT / "engine_patches" / "omnistage_engine_patches" / "contract.py").read_text())
    imported = {alias.name.split(".")[0] for node in ast.walk(tree) if isinstance(node, ast.Import)
                for alias in node.names}
    imported |= {node.module.split(".")[0] for node in ast.walk(tree)
                 if isinstance(node, ast.ImportFrom) and node.module and node.level == 0}
    assert imported <= set(sys.stdlib_module_names) | {"__future__"}, imported


def test_operator_runs_without_vllm_as_in_its_image():
    """The operator image has the plugin package but neither vLLM nor torch: every operator module
    must import with those unimportable."""
    import subprocess

    code = (
        "import sys\nfor name in ('vllm', 'vllm_omni', 'torch', 'fastapi'):\n    sys.modules[name] = None  # "
        "import fails, as in the operator image\nimport omnistage.cli, omnistage.runtime.handlers, "
        "omnistage.runtime.reconcile, omnistage.runtime.head_client\nimport "
        "omnistage_engine_patches.contract\nprint('ok', sorted(m for m in sys.modules if "
        "m.startswith('omnistage_engine_patches')))\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("ok"), proc.stdout
