"""`omnistage` as a user runs it."""

import subprocess
import sys

import yaml

from tests.support.repo import ROOT


def omnistage(*args, stdin=None):
    return subprocess.run([sys.executable, "-m", "omnistage", *args], capture_output=True, text=True,
                          input=stdin, cwd=ROOT, timeout=60, check=False)


def test_crd_command_prints_the_committed_crd():
    out = omnistage("crd")
    assert out.returncode == 0
    assert out.stdout == (ROOT / "crds/omnistage.serving.omnistage.io.yaml").read_text()


def test_render_sample():
    out = omnistage("render", "-f", "manifests/samples/omnistage.yaml")
    assert out.returncode == 0, out.stderr
    kinds = [d["kind"] for d in yaml.safe_load_all(out.stdout)]
    # The master token's Secret; after the head, the replica pod's own credential (NAME-replica-1-membership).
    assert kinds == [
        "ConfigMap",
        "Secret",
        "Service",
        "Service",
        "NetworkPolicy",
        "PodDisruptionBudget",
        "Pod",
        "Secret",
        "Pod",
    ]
    assert "effective stage-0 cache mode processor-only" in out.stderr


def test_render_invalid_file_names_field_and_fix():
    bad = (ROOT / "manifests/samples/omnistage.yaml").read_text().replace("mode: auto", "mode: lru")
    out = omnistage("render", "-f", "-", stdin=bad)
    assert out.returncode == 2 and out.stdout == ""
    assert "spec.cache.mode" in out.stderr and "Use cache.mode auto or processor-only" in out.stderr


def test_render_wrong_kind():
    out = omnistage("render", "-f", "-", stdin="apiVersion: v1\nkind: ConfigMap\nmetadata: {name: x}\n")
    assert out.returncode == 2 and "holds no OmniStage" in out.stderr


def test_run_refuses_a_head_probe_period_out_of_range_before_it_starts():
    for bad in ("0.1", "61", "soon"):
        out = omnistage("run", "--probe-heads-every", bad)
        assert out.returncode == 2, (bad, out.stderr)
        assert "--probe-heads-every" in out.stderr and "give seconds from 0.5 to 60" in out.stderr, out.stderr


def test_run_refuses_a_full_pass_period_out_of_range_before_it_starts():
    for bad in ("5", "3601", "soon"):
        out = omnistage("run", "--full-pass-every", bad)
        assert out.returncode == 2, (bad, out.stderr)
        assert "--full-pass-every" in out.stderr and "give seconds from 10 to 3600" in out.stderr, out.stderr
