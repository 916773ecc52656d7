"""hack/kube-score.sh's report: kube-score's JSON per input -> a table of counts and the findings
grouped by check, each with its judgement from the judged list; exit 1 when one has none.

    kube-score-report.py JUDGED INPUT.json...    (INPUT: what rendered it, / written as +)
"""

from __future__ import annotations

import json
import sys
from collections import Counter, defaultdict
from dataclasses import dataclass
from fnmatch import fnmatchcase
from pathlib import Path

# kube-score's grades (scorecard.Grade): what -o ci prints as [CRITICAL] and [WARNING].
GRADES = {1: "CRITICAL", 5: "WARNING"}


@dataclass(frozen=True)
class Finding:
    input: str
    object: str  # Kind/name
    check: str  # the check's id
    optional: bool
    grade: str
    summary: str


@dataclass(frozen=True)
class Judged:
    """One line of the judged list: globs over a finding, and why it is acceptable."""
    check: str
    input: str
    object: str
    summary: str
    reason: str

    def covers(self, f: Finding) -> bool:
        return (self.check == f.check and fnmatchcase(f.input, self.input) and fnmatchcase(f.object, self.object)
                and fnmatchcase(f.summary, self.summary))


def read_judged(path: Path) -> list[Judged]:
    """`check | input | object | finding | reason` per line; # starts a comment."""
    judged = []
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        fields = [x.strip() for x in line.split("|", 4)]
        if len(fields) != 5 or not all(fields):
            sys.exit(f"{path}:{n}: expected 'check | input | object | finding | reason', got {line!r}")
        judged.append(Judged(*fields))
    return judged


def input_name(path: Path) -> str:
    return path.name.removesuffix(".json").replace("+", "/")


def findings(path: Path) -> list[Finding]:
    """One per line -o ci would print as CRITICAL or WARNING (a comment, or the check itself)."""
    name, out = input_name(path), []
    for obj in json.loads(path.read_text()) or []:  # null: nothing kube-score checks (monitoring's objects)
        ref = f"{obj['type_meta']['kind']}/{obj['object_meta']['name']}"
        for c in obj["checks"]:
            grade = GRADES.get(c["grade"])
            if c["skipped"] or grade is None:
                continue
            summaries = [m["summary"] for m in c["comments"] or []] or [c["check"]["name"]]
            out += [Finding(name, ref, c["check"]["id"], c["check"]["optional"], grade, s) for s in summaries]
    return out


def main(judged_path: str, *scored: str) -> int:
    judged = read_judged(Path(judged_path))
    per_input = {input_name(Path(p)): findings(Path(p)) for p in scored}
    every = [f for fs in per_input.values() for f in fs]
    why = {f: next((j for j in judged if j.covers(f)), None) for f in set(every)}

    print("| input | CRITICAL | WARNING | optional (seccomp) | not judged |")
    print("|---|---|---|---|---|")
    for name, fs in per_input.items():
        default = Counter(f.grade for f in fs if not f.optional)
        print(f"| `{name}` | {default['CRITICAL']} | {default['WARNING']} | {sum(f.optional for f in fs)} "
              f"| {sum(why[f] is None for f in fs)} |")

    groups: dict[tuple[str, str, str], list[Finding]] = defaultdict(list)
    for f in every:
        groups[(f.check, f.summary, f.grade)].append(f)
    print("\nFindings by check (objects x how many inputs render them):")
    # The ones with a finding not judged first, then by check.
    for (check, summary, grade), fs in sorted(groups.items(), key=lambda g: (all(why[f] for f in g[1]), g[0])):
        objects = ", ".join(f"{o} x{n}" if n > 1 else o for o, n in sorted(Counter(f.object for f in fs).items()))
        unjudged = [f for f in fs if why[f] is None]
        print(f"  {'NOT JUDGED' if unjudged else 'judged'}  {check}: {summary} ({grade}, {len(fs)}: {objects})")
        for reason in sorted({why[f].reason for f in fs if why[f] is not None}):
            print(f"      acceptable: {reason}")
        if unjudged:
            print(f"      in: {', '.join(sorted({f.input for f in unjudged}))}")

    unused = [j for j in judged if not any(j.covers(f) for f in every)]
    if unused:
        print("\nJudged lines no finding matched (fixed since? then delete them):")
        for j in unused:
            print(f"  {j.check} | {j.input} | {j.object} | {j.summary}")
    missing = sum(why[f] is None for f in every)
    if missing:
        print(f"\n{missing} findings are not in {judged_path}: fix them, or judge them there with the reason")
        return 1
    print(f"\nEvery finding is judged acceptable in {judged_path}.")
    return 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:]))
