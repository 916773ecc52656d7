"""How the patches are installed: the wrapper order patches/__init__.py promises, and that an install never
takes vLLM down.

Real here: the plugin loaded through vLLM's own plugin loader (conftest's ``engine_patches``)
onto the real vllm 0.30.0 / vllm-omni 0.30.0 classes; every install function of every patch,
run in a subprocess of this interpreter (the project venv) against the real upstream modules,
with one upstream module at a time made unimportable the way a future release that renamed it
would (``sys.modules[name] = None``, and the attribute on its parent package removed, which is
what ``from package import module`` reads first). The subprocess keeps that breakage, and the
wrappers the installs put on the real classes, out of this test process.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytest.importorskip("vllm_omni", reason="engine tier needs vllm_omni 0.30.0 (run hack/setup.sh)")

from omnistage_engine_patches import _patching, contract, patches
from omnistage_engine_patches._patching import is_ours

pytestmark = pytest.mark.engine

ROOT = Path(__file__).resolve().parents[2]

# Every patch's install function, as ``module:function`` of omnistage_engine_patches: the registry's.
INSTALLS = {p.name: f"{p.install.__module__.removeprefix('omnistage_engine_patches.')}:{p.install.__name__}"
            for p in patches.PATCHES}


def test_every_patch_has_an_install_here():
    """Guard: every patch in contract.PATCHES is in the registry once (and so tested below)."""
    assert sorted(p.name for p in patches.PATCHES) == sorted(contract.PATCHES)


def test_do_register_chain_has_membership_outside_replica_metrics(engine_patches):
    """``MembershipController._do_register`` is wrapped twice; the registry (patches/__init__.py) applies replica_metrics
    first, so membership's wrapper is the outer one: its zombie detach (a replica told to leave
    while attaching) runs after replica_metrics registered the series, and removes them."""
    for name in (contract.REPLICA_METRICS, contract.MEMBERSHIP):
        if not _patching.applied(name):
            pytest.skip(f"patch {name} is not applied in this run: {_patching.outcomes().get(name)}")
    from vllm_omni.engine.membership_controller import MembershipController

    chain = []
    fn = MembershipController._do_register
    while fn is not None and len(chain) < 16:
        chain.append(fn)
        fn = getattr(fn, "__wrapped__", None)
    # Each wrapper's own tag, outermost first (functools.wraps copies the wrapped function's
    # __dict__, so a tag must be read where it was set: mark() sets it after the copy).
    tags = [vars(f).get(_patching.PATCHED_ATTR) for f in chain]
    assert tags == [contract.MEMBERSHIP, contract.REPLICA_METRICS, None]
    outer, inner, upstream = chain
    assert is_ours(outer, contract.MEMBERSHIP) and not is_ours(outer.__wrapped__, contract.MEMBERSHIP)
    assert is_ours(inner, contract.REPLICA_METRICS) and not is_ours(inner.__wrapped__)
    assert upstream.__module__ == "vllm_omni.engine.membership_controller"
    # is_ours walks the chain: both patches are found from the outside.
    assert is_ours(outer, contract.REPLICA_METRICS) and is_ours(outer, contract.MEMBERSHIP)


# The subprocess: for each install function, find the upstream modules it imports (its own import
# statements, from its source), hide each in turn and apply the patch; report every outcome.
_HIDE_AND_INSTALL = textwrap.dedent('''
    import ast, importlib, importlib.util, inspect, json, sys, textwrap
    import vllm_omni  # noqa: F401  (vLLM and vllm-omni are imported before plugins load, as in vLLM)
    from omnistage_engine_patches import _patching

    installs = json.loads(sys.argv[1])

    def upstream_imports(fn):
        tree = ast.parse(textwrap.dedent(inspect.getsource(fn)))
        found = []
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                names = [node.module]
                for alias in node.names:  # "from package import module" names a module too
                    sub = f"{node.module}.{alias.name}"
                    try:
                        if importlib.util.find_spec(sub) is not None:
                            names.append(sub)
                    except (ImportError, ValueError):
                        pass
            else:
                continue
            found += [n for n in names if n.split(".")[0] in ("vllm", "vllm_omni") and n not in found]
        return found

    def hidden(name):
        """Make ``name`` unimportable; return how to undo it."""
        importlib.import_module(name)
        parent, _, child = name.rpartition(".")
        saved_module = sys.modules[name]
        saved_attr = getattr(sys.modules.get(parent), child, None) if parent else None
        sys.modules[name] = None
        if saved_attr is not None:
            delattr(sys.modules[parent], child)

        def undo():
            sys.modules[name] = saved_module
            if saved_attr is not None:
                setattr(sys.modules[parent], child, saved_attr)
        return undo

    results = []
    for patch, target in installs.items():
        module_name, func = target.split(":")
        install = getattr(importlib.import_module("omnistage_engine_patches." + module_name), func)
        modules = upstream_imports(install)
        results.append({"patch": patch, "imports": modules})
        for name in modules:
            undo = hidden(name)
            try:
                # A label per case: apply_patch records one outcome per name and process.
                outcome = _patching.apply_patch(f"{patch} without {name}", install)
                results.append({"patch": patch, "hidden": name, "outcome": outcome.outcome, "reason": outcome.reason})
            except BaseException as err:  # what the test exists to rule out
                results.append({"patch": patch, "hidden": name, "raised": f"{type(err).__name__}: {err}"})
            finally:
                undo()

    # The plugin's entry point as vLLM's loader calls it, with a module three patches need gone.
    undo = hidden("vllm_omni.engine.orchestrator")
    try:
        import omnistage_engine_patches
        omnistage_engine_patches.apply()
        results.append({"entry_point": {n: [o.outcome, o.reason] for n, o in _patching.outcomes().items()
                                        if " without " not in n}})
    except BaseException as err:
        results.append({"entry_point_raised": f"{type(err).__name__}: {err}"})
    finally:
        undo()
    print("RESULTS " + json.dumps(results))
''')


@pytest.fixture(scope="module")
def hidden_module_results() -> list[dict]:
    env = {k: v for k, v in os.environ.items() if k != contract.DISABLE_PATCHES_ENV}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    print(f"running every install with each upstream module it imports hidden ({sys.executable}) ...", flush=True)
    proc = subprocess.run([sys.executable, "-c", _HIDE_AND_INSTALL, json.dumps(INSTALLS)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600, check=False)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULTS ")]
    assert proc.returncode == 0 and lines, f"exit {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    return json.loads(lines[-1].removeprefix("RESULTS "))


def test_install_never_crashes_vllm(hidden_module_results):
    """Regression: with any upstream module an install imports gone (a future vllm-omni renamed
    it), applying the patch records ``skipped`` with a reason naming the module; nothing raises
    into vLLM's plugin loader, which would stop every head, engine core and worker."""
    found = {r["patch"]: r["imports"] for r in hidden_module_results if "imports" in r}
    assert set(found) == set(INSTALLS)
    # The discovery sees what each install really imports (a broken discovery would test nothing).
    assert "vllm_omni.engine.membership_controller" in found[contract.MEMBERSHIP]
    assert "vllm_omni.engine.orchestrator" in found[contract.REPLICA_METRICS]
    assert "vllm_omni.engine.omni_engine_base" in found[contract.MM_CACHE_METRICS]
    assert "vllm_omni.engine.omni_engine_base" in found[contract.FRONTEND_CACHE]
    assert "vllm_omni.engine.async_omni_engine" in found[contract.UUID_SCOPE]
    cases = [r for r in hidden_module_results if "hidden" in r]
    assert len(cases) == sum(len(v) for v in found.values()) >= 12
    for case in cases:
        assert "raised" not in case, case
        assert case["outcome"] == contract.SKIPPED, case
        assert case["hidden"].rpartition(".")[2] in case["reason"], case


def test_entry_point_survives_a_missing_orchestrator_module(hidden_module_results):
    """Regression: the plugin's entry point (``omnistage_engine_patches.apply``, what vLLM's loader
    calls in every process) returns normally with ``vllm_omni.engine.orchestrator`` gone: the
    three patches that need it are skipped, and the others still apply."""
    (entry,) = [r for r in hidden_module_results if "entry_point" in r or "entry_point_raised" in r]
    assert "entry_point_raised" not in entry, entry
    outcomes = entry["entry_point"]
    assert set(outcomes) == set(contract.PATCHES)
    for name in (contract.REPLICA_METRICS, contract.MM_CACHE_METRICS, contract.MEMBERSHIP):
        assert outcomes[name][0] == contract.SKIPPED and "orchestrator" in outcomes[name][1], (name, outcomes[name])
    for name in (contract.FRONTEND_CACHE, contract.UUID_SCOPE):
        assert outcomes[name][0] == contract.APPLIED, (name, outcomes[name])
