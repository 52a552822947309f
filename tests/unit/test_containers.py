"""No Docker engine runs here, so the compose file and Dockerfile are validated offline."""

from __future__ import annotations

import subprocess
from pathlib import Path

import compose
import pytest

ROOT = Path(__file__).resolve().parents[2]
COMPOSE_BIN = Path(compose.__file__).parent / "docker-compose"


@pytest.mark.parametrize("profile", [None, "gpu"], ids=["default", "gpu-profile"])
def test_compose_file_is_valid(profile):
    args = [str(COMPOSE_BIN), "-f", str(ROOT / "docker-compose.yml")]
    if profile:
        args += ["--profile", profile]
    r = subprocess.run([*args, "config", "--quiet"], capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert r.returncode == 0, r.stderr


def test_compose_declares_the_suite():
    r = subprocess.run([str(COMPOSE_BIN), "-f", str(ROOT / "docker-compose.yml"), "config", "--services"],
                       capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert set(r.stdout.split()) == {"redis", "pricer", "predictor", "allocator", "node-agent-1", "node-agent-2"}


def test_compose_rejects_a_broken_file(tmp_path):
    """Guards the validator itself: a malformed file must fail, or the test above proves nothing."""
    bad = tmp_path / "docker-compose.yml"
    bad.write_text("services:\n  x:\n    image: a\n    healthcheck:\n      interval: notaduration\n")
    r = subprocess.run([str(COMPOSE_BIN), "-f", str(bad), "config", "--quiet"], capture_output=True, text=True, timeout=60)
    assert r.returncode != 0


def test_dockerfile_builds_stubs_and_runs_unprivileged():
    text = (ROOT / "Dockerfile").read_text()
    assert "grpc_tools.protoc" in text and "USER 10001" in text
