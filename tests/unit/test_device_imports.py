"""What the GPU machine imports: ``services.node_agent.gpu`` pulls in no co-location model, service or numpy.

The device check runs the node agent's real ``NvmlBackend`` on a machine with no virtualenv, where structlog is the
one package carried (``make device-deps``). It may stay that way only while ``gpu.py`` and the ``elastico`` modules
under it import the standard library and structlog alone, and while the check fakes no module into ``sys.modules``.
"""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
FORBIDDEN = ("elastico.coloc", "services.allocator", "services.pricer", "services.predictor", "simulator", "numpy")
ELASTICO_ALLOWED = {"elastico", "elastico.domain", "elastico.errors", "elastico.limits", "elastico.logging"}

_PROBE = """
import json, sys
before = set(sys.modules)
import services.node_agent.gpu
print(json.dumps({"all": sorted(sys.modules), "new": sorted(set(sys.modules) - before)}))
"""


def _under(name: str, prefix: str) -> bool:
    return name == prefix or name.startswith(prefix + ".")


def test_importing_the_gpu_module_loads_no_model_service_or_numpy() -> None:
    res = subprocess.run([sys.executable, "-c", _PROBE], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stderr
    mods = json.loads(res.stdout)
    loaded = [m for m in mods["all"] if any(_under(m, p) for p in FORBIDDEN)]
    assert not loaded, loaded
    new = mods["new"]
    assert {m for m in new if _under(m, "elastico")} <= ELASTICO_ALLOWED, new
    assert {m for m in new if _under(m, "services")} == {"services", "services.node_agent", "services.node_agent.gpu"}


def test_the_gpu_module_and_its_elastico_imports_use_only_the_stdlib_and_structlog() -> None:
    """Module-level imports (those a function makes when it runs are its own business, e.g. pynvml)."""
    shared = sorted(ELASTICO_ALLOWED - {"elastico"})
    paths = ["services/node_agent/gpu.py", *(f"{m.replace('.', '/')}.py" for m in shared)]
    allowed = set(sys.stdlib_module_names) | {"structlog"}
    for rel in paths:
        tree = ast.parse((REPO / rel).read_text(), rel)
        for node in tree.body:
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module == "elastico":
                names = [f"elastico.{a.name}" for a in node.names]  # from elastico import limits
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            else:
                continue
            for name in names:
                ok = name.split(".")[0] in allowed or name in ELASTICO_ALLOWED
                assert ok, f"{rel}:{node.lineno} imports {name}"


def test_device_check_never_touches_sys_modules() -> None:
    sources = sorted((REPO / "bench" / "device_check").glob("*.py"))
    assert sources
    for path in sources:
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if (isinstance(node, ast.Attribute) and node.attr == "modules"
                    and isinstance(node.value, ast.Name) and node.value.id == "sys"):
                raise AssertionError(f"{path.name}:{node.lineno} uses sys.modules")
