"""The one way a service builds its Kubernetes API client (the official ``kubernetes`` package)."""

from __future__ import annotations

from kubernetes import client, config

from elastico.errors import ConfigError


def api_client(api_url: str = "") -> client.ApiClient:
    """An ApiClient for ``api_url`` ("" = the in-cluster service account, else ``~/.kube/config``).

    Raises:
        ConfigError: neither a service account nor a kubeconfig (the process exits 2 saying so).
    """
    cfg = client.Configuration()
    if api_url:
        cfg.host = api_url
    else:
        try:
            config.load_incluster_config(client_configuration=cfg)
        except config.ConfigException:
            try:
                config.load_kube_config(client_configuration=cfg)
            except (config.ConfigException, OSError) as exc:
                raise ConfigError("no Kubernetes API: not in a pod with a service account, and no usable kubeconfig "
                                  f"({exc}); set ELASTICO_KUBE_API_URL") from None
    return client.ApiClient(cfg)
