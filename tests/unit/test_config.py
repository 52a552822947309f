"""Settings.from_env: typed parsing and fail-fast validation with the variable named."""

from __future__ import annotations

import pytest

from elastico.config import Settings
from elastico.errors import ConfigError
from services.allocator.settings import AllocatorSettings
from services.node_agent.settings import NodeAgentSettings
from services.predictor.settings import PredictorSettings
from services.pricer.settings import PricerSettings

INSECURE = {"ELASTICO_INSECURE": "1"}


def test_defaults_and_overrides_parse_types():
    s = PricerSettings.from_env({**INSECURE, "ELASTICO_PORT": "6000", "ELASTICO_SHUTDOWN_GRACE_S": "1.5", "ELASTICO_LOG_FORMAT": "json"})
    assert (s.port, s.shutdown_grace_s, s.log_format, s.service_name) == (6000, 1.5, "json", "pricer")
    assert PredictorSettings.from_env(INSECURE).port == 50052


@pytest.mark.parametrize(
    ("cls", "env", "var"),
    [
        (PricerSettings, {"ELASTICO_PORT": "abc"}, "ELASTICO_PORT"),
        (PricerSettings, {"ELASTICO_PORT": "70000"}, "ELASTICO_PORT"),
        (PricerSettings, {"ELASTICO_LOG_LEVEL": "loud"}, "ELASTICO_LOG_LEVEL"),
        (PricerSettings, {"ELASTICO_DEFAULT_GAP_TOLERANCE": "2"}, "ELASTICO_DEFAULT_GAP_TOLERANCE"),
        (AllocatorSettings, {}, "ELASTICO_REDIS_URL"),
        (AllocatorSettings, {"ELASTICO_REDIS_URL": "http://x"}, "ELASTICO_REDIS_URL"),
        (NodeAgentSettings, {"ELASTICO_REDIS_URL": "redis://h:1", "ELASTICO_GPU_BACKEND": "cuda"}, "ELASTICO_GPU_BACKEND"),
        (NodeAgentSettings, {"ELASTICO_REDIS_URL": "redis://h:1", "ELASTICO_SIM_GPU_COUNT": "0"}, "ELASTICO_SIM_GPU_COUNT"),
        (Settings, {"ELASTICO_METRICS_PORT": "-5"}, "ELASTICO_METRICS_PORT"),
        (NodeAgentSettings, {"ELASTICO_REDIS_URL": "redis://h:1", "ELASTICO_ALLOCATOR_ADDRESSES": "a:50050,b"},
         "ELASTICO_ALLOCATOR_ADDRESSES"),
        (NodeAgentSettings, {"ELASTICO_REDIS_URL": "redis://h:1", "ELASTICO_ALLOCATOR_ADDRESSES": "a:70000"},
         "ELASTICO_ALLOCATOR_ADDRESSES"),
        (AllocatorSettings, {"ELASTICO_REDIS_URL": "redis://h:1", "ELASTICO_SERVICE_QUOTA_GPUS": "team-a=1.5"},
         "ELASTICO_SERVICE_QUOTA_GPUS"),
        # NaN passes every range check written as a comparison, inf every "> 0": refused when parsed
        (AllocatorSettings, {"ELASTICO_REDIS_URL": "redis://h:1", "ELASTICO_NODE_STALE_S": "nan"}, "ELASTICO_NODE_STALE_S"),
        (AllocatorSettings, {"ELASTICO_REDIS_URL": "redis://h:1", "ELASTICO_LEASE_TTL_S": "inf"}, "ELASTICO_LEASE_TTL_S"),
        (PricerSettings, {"ELASTICO_SHUTDOWN_GRACE_S": "1e309"}, "ELASTICO_SHUTDOWN_GRACE_S"),
        # a Redis URL naming no host meant localhost:6379, whatever Redis runs there
        (AllocatorSettings, {"ELASTICO_REDIS_URL": "redis://"}, "ELASTICO_REDIS_URL"),
        (AllocatorSettings, {"ELASTICO_REDIS_URL": "redis://127.0.0.1:notaport/0"}, "ELASTICO_REDIS_URL"),
        (AllocatorSettings, {"ELASTICO_REDIS_URL": "redis://127.0.0.1:6390/abc"}, "ELASTICO_REDIS_URL"),
        (PricerSettings, {"ELASTICO_PORT_FILE": "/nonexistent-dir/port"}, "ELASTICO_PORT_FILE"),
        (PricerSettings, {"ELASTICO_PORT_FILE": "/tmp"}, "ELASTICO_PORT_FILE"),
        # every *_address / *_addresses is checked as host:port when read, not at the first dial
        (AllocatorSettings, {"ELASTICO_REDIS_URL": "redis://h:1", "ELASTICO_PREDICTOR_ADDRESS": "pred:"},
         "ELASTICO_PREDICTOR_ADDRESS"),
        (AllocatorSettings, {"ELASTICO_REDIS_URL": "redis://h:1", "ELASTICO_PRICER_ADDRESS": "pri cer:50051"},
         "ELASTICO_PRICER_ADDRESS"),
        (NodeAgentSettings, {"ELASTICO_REDIS_URL": "redis://h:1", "ELASTICO_ADVERTISE_ADDRESS": "::1:50054"},
         "ELASTICO_ADVERTISE_ADDRESS"),
        (NodeAgentSettings, {"ELASTICO_REDIS_URL": "redis://h:1", "ELASTICO_NODE_ID": "../n1"}, "ELASTICO_NODE_ID"),
        (NodeAgentSettings, {"ELASTICO_REDIS_URL": "redis://h:1", "ELASTICO_NODE_ID": "a/b"}, "ELASTICO_NODE_ID"),
    ],
    ids=["port-not-int", "port-range", "log-level", "gap-tolerance", "redis-required", "redis-scheme", "gpu-backend",
         "sim-gpu-count", "metrics-port", "allocator-address", "allocator-port", "service-quota", "nan", "inf",
         "overflow", "redis-no-host", "redis-port", "redis-db", "port-file-dir-missing", "port-file-is-dir",
         "address-no-port", "address-blank", "address-ipv6-unbracketed", "node-id-dots", "node-id-slash"],
)
def test_bad_settings_fail_fast_naming_the_variable(cls, env, var):
    with pytest.raises(ConfigError, match=var):
        cls.from_env(env)


def test_bool_parsing():
    from dataclasses import dataclass

    @dataclass(frozen=True)
    class WithFlag(Settings):
        flag: bool = False

    assert WithFlag.from_env({**INSECURE, "ELASTICO_FLAG": "yes"}).flag is True
    with pytest.raises(ConfigError, match="ELASTICO_FLAG"):
        WithFlag.from_env({"ELASTICO_FLAG": "maybe"})


def test_service_refuses_to_start_on_bad_config(tmp_path):
    import subprocess
    import sys

    r = subprocess.run([sys.executable, "-m", "services.allocator"], env={"PATH": "/usr/bin:/bin", **INSECURE},
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2
    assert "ELASTICO_REDIS_URL is required" in r.stderr


def test_a_directory_setting_must_not_be_a_file_nor_a_file_setting_a_directory(tmp_path):
    a_file = tmp_path / "f"
    a_file.write_text("x")
    agent = {**INSECURE, "ELASTICO_REDIS_URL": "redis://h:1"}
    with pytest.raises(ConfigError, match="ELASTICO_STATE_DIR"):
        NodeAgentSettings.from_env({**agent, "ELASTICO_STATE_DIR": str(a_file)})
    with pytest.raises(ConfigError, match="ELASTICO_MPS_PIPE_DIR"):
        NodeAgentSettings.from_env({**agent, "ELASTICO_MPS_PIPE_DIR": str(a_file)})
    with pytest.raises(ConfigError, match="ELASTICO_MODEL_PATH"):
        PredictorSettings.from_env({**INSECURE, "ELASTICO_MODEL_PATH": str(tmp_path)})


def test_a_taken_port_is_one_line_and_exit_3_not_a_traceback():
    import socket
    import subprocess
    import sys

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        for var in ("ELASTICO_PORT", "ELASTICO_METRICS_PORT"):
            r = subprocess.run([sys.executable, "-m", "services.pricer"], capture_output=True, text=True, timeout=60,
                               env={"PATH": "/usr/bin:/bin", **INSECURE, "ELASTICO_PORT": "0", var: str(port)})
            assert r.returncode == 3 and var in r.stderr and "Traceback" not in r.stderr, r.stderr


def test_a_predictor_that_cannot_reach_its_redis_exits_3():
    import socket
    import subprocess
    import sys

    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    r = subprocess.run([sys.executable, "-m", "services.predictor"], capture_output=True, text=True, timeout=60,
                       env={"PATH": "/usr/bin:/bin", **INSECURE, "ELASTICO_PORT": "0",
                            "ELASTICO_REDIS_URL": f"redis://127.0.0.1:{port}/0"})
    assert r.returncode == 3 and "redis unavailable" in r.stderr and "Traceback" not in r.stderr, r.stderr


def test_allocator_addresses_are_a_comma_separated_list():
    s = NodeAgentSettings.from_env({**INSECURE, "ELASTICO_REDIS_URL": "redis://h:1",
                                    "ELASTICO_ALLOCATOR_ADDRESSES": " alloc-0:50050, 10.0.0.2:50050 ,"})
    assert s.allocator_address_list == ("alloc-0:50050", "10.0.0.2:50050")
    assert NodeAgentSettings.from_env({**INSECURE, "ELASTICO_REDIS_URL": "redis://h:1"}).allocator_address_list == ()


@pytest.mark.parametrize("address", ["alloc-0:50050", "10.0.0.2:1", "[::1]:50051", "dns:///alloc.svc:50050",
                                     "unix:/run/elastico/pricer.sock"])
def test_well_formed_addresses_are_accepted(address):
    s = AllocatorSettings.from_env({**INSECURE, "ELASTICO_REDIS_URL": "redis://h:1", "ELASTICO_PRICER_ADDRESS": address})
    assert s.pricer_address == address


def test_the_hostname_fallback_is_a_valid_node_id():
    s = NodeAgentSettings.from_env({**INSECURE, "ELASTICO_REDIS_URL": "redis://h:1"})
    assert s.effective_node_id


def test_no_kubernetes_api_is_a_configuration_error(monkeypatch, tmp_path):
    from elastico.kubeclient import api_client

    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setenv("KUBECONFIG", str(tmp_path / "none"))
    with pytest.raises(ConfigError, match="ELASTICO_KUBE_API_URL"):
        api_client("")
    assert api_client("http://127.0.0.1:9").configuration.host == "http://127.0.0.1:9"
