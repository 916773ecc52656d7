"""hack/kube-score.sh's verdict (hack/kube-score-report.py): a finding the judged list does not
cover fails the run, so that a fixed finding coming back shows. kube-score itself is not run here
(make kube-score builds and runs it); its JSON is written by hand in the shape v1.20.0 prints."""

from __future__ import annotations

import json
from pathlib import Path

from tests.support.repo import ROOT, hack_script

JUDGED = ROOT / "hack" / "kube-score-judged.txt"


def report():
    return hack_script("kube-score-report.py")


def scored(tmp_path: Path, input_name: str, kind: str, name: str, *checks: tuple[str, int, str]) -> str:
    """kube-score's -o json for one object: (check id, grade, comment summary) per failed check."""
    obj = {"object_name": f"{kind}/{name}", "type_meta": {"kind": kind}, "object_meta": {"name": name},
           "checks": [{"check": {"id": c, "name": c, "optional": False}, "grade": g, "skipped": False,
                       "comments": [{"path": "engine", "summary": s}]} for c, g, s in checks]
           + [{"check": {"id": "stable-version", "name": "Stable version", "optional": False}, "grade": 10,
               "skipped": False, "comments": None}]}
    path = tmp_path / f"{input_name.replace('/', '+')}.json"
    path.write_text(json.dumps([obj]))
    return str(path)


def test_the_committed_judged_list_parses_and_names_a_reason_for_every_line():
    judged = report().read_judged(JUDGED)
    assert judged and all(j.reason for j in judged)


def test_judged_findings_pass_and_one_more_fails(tmp_path, capsys):
    r = report()
    sample = "omnistage render -f manifests/samples/omnistage.yaml"
    ok = scored(tmp_path, sample, "Pod", "qwen3-omni-head",
                ("container-resources", 1, "CPU limit is not set"),
                ("pod-networkpolicy", 5, "The pod does not have a matching egress NetworkPolicy"))
    assert r.main(str(JUDGED), ok) == 0
    regressed = scored(tmp_path, sample, "Pod", "qwen3-omni-replica-1",
                       ("pod-networkpolicy", 1, "The pod does not have a matching NetworkPolicy"))
    assert r.main(str(JUDGED), ok, regressed) == 1
    out = capsys.readouterr().out
    assert "NOT JUDGED  pod-networkpolicy: The pod does not have a matching NetworkPolicy" in out
    assert f"| `{sample}` | 1 | 0 | 0 | 1 |" in out


def test_an_ephemeral_storage_request_is_excused_only_where_the_weights_are_on_a_volume(tmp_path):
    """The production sample mounts spec.modelVolume; without it the download's request must be there."""
    r = report()
    finding = ("container-ephemeral-storage-request-and-limit", 1, "Ephemeral Storage request is not set")
    on_volume = scored(
        tmp_path, "omnistage render -f manifests/samples/omnistage-production.yaml", "Pod", "h", finding
    )
    assert r.main(str(JUDGED), on_volume) == 0
    downloading = scored(
        tmp_path, "omnistage render -f manifests/samples/omnistage.yaml", "Pod", "h", finding
    )
    assert r.main(str(JUDGED), downloading) == 1
