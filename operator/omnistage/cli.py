"""The `omnistage` command: print the CRD, render an OmniStage's children, run the operator."""

from __future__ import annotations

import argparse
import os
import secrets
import sys

import yaml

from . import api
from .api import security
from .api.crd import crd_yaml
from .api.validation import InvalidSpec
from .control import pools
from .names import LEASE_NAME
from .render import render_children, target_from
from .render.common import Pool, Target
from .yamlio import dump_all

PLACEHOLDER_HEAD_IP = "HEAD_POD_IP"
PLACEHOLDER_HEAD_UID = "HEAD_POD_UID"


def _load_omnistages(path: str) -> tuple[list[dict], list[dict]]:
    """The OmniStages of a file and its OmniStagePools."""
    with (sys.stdin if path == "-" else open(path)) as f:
        docs = [d for d in yaml.safe_load_all(f) if d]
    found = [d for d in docs if d.get("kind") == api.KIND]
    if not found:
        expected = f"expected apiVersion {api.GROUP}/{api.VERSION}, kind {api.KIND}"
        raise InvalidSpec([("kind", f"{path} holds no {api.KIND} ({expected})")])
    pool_objs = [d for d in docs if d.get("kind") == api.POOL_KIND]
    for d in found + pool_objs:
        if d.get("apiVersion") != f"{api.GROUP}/{api.VERSION}":
            raise InvalidSpec(
                [("apiVersion", f"is {d.get('apiVersion')!r}; expected {api.GROUP}/{api.VERSION}")]
            )
    return found, pool_objs


def runnable_pools(t: Target, pool_objs: list[dict]) -> list[Pool]:
    """The pools of `pool_objs` that name `t` and can run; InvalidSpec naming the first that cannot."""
    fitted = pools.fit(t, t.name, [p for p in pool_objs if (p.get("spec") or {}).get("omniStage") == t.name])
    refused = [(f"{api.POOL_KIND} {f.name}", f"{f.problem[0]}: {f.problem[1]}") for f in fitted if f.problem]
    if refused:
        raise InvalidSpec(refused)
    return [f.pool for f in fitted]


def cmd_crd(_: argparse.Namespace) -> int:
    sys.stdout.write(crd_yaml())
    return 0


def cmd_docs(_: argparse.Namespace) -> int:
    from .api.docs import reference_markdown

    sys.stdout.write(reference_markdown())
    return 0


def cmd_render(args: argparse.Namespace) -> int:
    if args.allowed_host_paths is not None:
        # Where the reconcile loop reads it too (operator_main.run), so render refuses what a pass would.
        os.environ[security.ALLOWED_HOST_PATHS_ENV] = args.allowed_host_paths
    try:
        objs, pool_objs = _load_omnistages(args.filename)
        targets = [target_from(o, default_image=args.engine_image) for o in objs]
        runs = {t.name: runnable_pools(t, pool_objs) for t in targets}
    except InvalidSpec as err:
        print(f"error: invalid {api.KIND} in {args.filename}:", file=sys.stderr)
        for field, message in err.problems:
            print(f"  {field}: {message}", file=sys.stderr)
        return 2
    except (OSError, yaml.YAMLError) as err:
        print(f"error: cannot read {args.filename}: {err}", file=sys.stderr)
        return 2
    docs = []
    for t in targets:
        print(f"# {t.namespace}/{t.name}: effective stage-0 cache mode {t.cache.mode} ({t.cache.reason}); "
              f"engine image {t.engine_image}", file=sys.stderr)
        token = args.token or secrets.token_urlsafe(32)
        docs += render_children(t, token, args.head_ip, args.head_uid, runs[t.name]).all()
    sys.stdout.write(dump_all(docs))
    return 0


def cmd_run(args: argparse.Namespace) -> int:
    from .operator_main import run  # kopf is imported only when the operator runs

    return run(
        namespaces=args.namespace,
        metrics_port=args.metrics_port,
        probe_port=args.probe_port,
        bind=args.bind_address,
        engine_image=args.engine_image,
        allowed_host_paths=args.allowed_host_paths,
        lease_namespace=args.leader_election_namespace,
        lease_name=args.leader_election_id,
        probe_heads_every=args.probe_heads_every,
        full_pass_every=args.full_pass_every,
    )


def _seconds_from(low: float, high: float):
    def parse(text: str) -> float:
        try:
            seconds = float(text)
        except ValueError:
            seconds = -1.0
        if not low <= seconds <= high:
            raise argparse.ArgumentTypeError(f"{text!r}: give seconds from {low:g} to {high:g}")
        return seconds
    return parse


_probe_period = _seconds_from(0.5, 60)
_full_pass_period = _seconds_from(10, 3600)


def _host_paths(text: str) -> str:
    try:
        security.parse_allowed_host_paths(text)
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None
    return text


def _add_allowed_host_paths(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--allowed-host-paths",
        type=_host_paths,
        metavar="DIR[,DIR...]",
        help="host directories (comma-separated absolute prefixes) an OmniStage's spec.modelVolume.hostPath "
        f"may name (default: ${security.ALLOWED_HOST_PATHS_ENV}, else none)",
    )


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="omnistage", description=__doc__)
    sub = p.add_subparsers(dest="command", required=True)
    sub.add_parser("crd", help="print the OmniStage CustomResourceDefinition").set_defaults(func=cmd_crd)
    sub.add_parser("docs", help="print the OmniStage API reference (docs/reference.md)").set_defaults(
        func=cmd_docs
    )
    r = sub.add_parser("render", help="print every child manifest of an OmniStage (like helm template)")
    r.add_argument("-f", "--filename", required=True, help="OmniStage YAML file, or - for stdin")
    r.add_argument("--head-ip", default=PLACEHOLDER_HEAD_IP, help="head pod IP to render into replica pods")
    r.add_argument(
        "--head-uid", default=PLACEHOLDER_HEAD_UID, help="head pod UID to render into replica pods"
    )
    r.add_argument("--token", help="membership token (default: a random one)")
    r.add_argument("--engine-image", help=f"engine image where spec.engine.image is unset (default: "
                   f"${api.ENGINE_IMAGE_ENV}, else {api.DEFAULT_ENGINE_IMAGE})")
    _add_allowed_host_paths(r)
    r.set_defaults(func=cmd_render)
    run = sub.add_parser("run", help="run the operator (kopf)")
    run.add_argument("-n", "--namespace", action="append", default=[],
                     help="watch only this namespace (repeatable); default: all namespaces (namespaced "
                     "installs pass their own, --namespace=$(POD_NAMESPACE) from the downward API)")
    run.add_argument("--metrics-port", type=int, default=8080, help="Prometheus /metrics port (0: off)")
    run.add_argument(
        "--probe-port",
        type=int,
        default=8081,
        help="probe port: /healthz liveness, /readyz readiness (0: off)",
    )
    run.add_argument("--bind-address", help="address /metrics and the probes bind (default: "
                     "$OMNISTAGE_BIND_ADDRESS, else 127.0.0.1; the install manifests: the pod's IP)")
    run.add_argument("--engine-image", help=f"engine image of OmniStages that leave spec.engine.image unset "
                     f"(default: ${api.ENGINE_IMAGE_ENV}, else {api.DEFAULT_ENGINE_IMAGE})")
    _add_allowed_host_paths(run)
    run.add_argument("--probe-heads-every", type=_probe_period, default=5.0, metavar="SECONDS",
                     help="probe every head this often (default 5; 0.5 to 60): how soon a registration or a "
                     "restarted head engine is noticed, at one conditional GET per head each time")
    run.add_argument("--full-pass-every", type=_full_pass_period, default=60.0, metavar="SECONDS",
                     help="give every OmniStage a full pass this often (default 60; 10 to 3600): how soon a "
                     "deleted membership Secret is re-created while no pod needs it, at one GET per "
                     "OmniStage each time")
    run.add_argument(
        "--leader-election-namespace",
        help="namespace of the leader-election Lease (default: "
        "$POD_NAMESPACE, else the in-cluster ServiceAccount's; neither: no election, one replica only)",
    )
    run.add_argument("--leader-election-id", default=LEASE_NAME, help="name of the leader-election Lease")
    run.set_defaults(func=cmd_run)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
