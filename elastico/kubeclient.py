"""The one way a service builds its Kubernetes API client (the official ``kubernetes`` package)."""

from __future__ import annotations

from kubernetes import client, config


def api_client(api_url: str = "") -> client.ApiClient:
    """An ApiClient for ``api_url`` ("" = the in-cluster service account, else ``~/.kube/config``)."""
    cfg = client.Configuration()
    if api_url:
        cfg.host = api_url
    else:
        try:
            config.load_incluster_config(client_configuration=cfg)
        except config.ConfigException:
            config.load_kube_config(client_configuration=cfg)
    return client.ApiClient(cfg)
