"""Where the target and draft replicas are. A spec is one of:

    HOST:PORT[,HOST:PORT...]          a static list
    dns:NAME:PORT                     every address NAME resolves to (a headless Service)
    k8s:NAMESPACE/SERVICE:PORT        ready endpoints of the Service's EndpointSlices, watched
                                      through the Kubernetes API with in-cluster credentials
"""

from __future__ import annotations

import asyncio
import logging
import socket
import threading
from collections.abc import Iterable

log = logging.getLogger(__name__)


class Discovery:
    """Static list; the base of the dynamic kinds."""

    dynamic = False

    def __init__(self, addresses: list[str]) -> None:
        self._addresses = addresses

    async def addresses(self) -> list[str]:
        return list(self._addresses)

    def close(self) -> None:
        pass


class DnsDiscovery(Discovery):
    dynamic = True

    def __init__(self, name: str, port: int) -> None:
        super().__init__([])
        self.name, self.port = name, port

    async def addresses(self) -> list[str]:
        try:
            infos = await asyncio.get_running_loop().getaddrinfo(self.name, self.port, type=socket.SOCK_STREAM)
        except OSError as err:
            log.warning("cannot resolve %s: %s", self.name, err)
            return []
        return sorted({f"{info[4][0]}:{self.port}" for info in infos})


def ready_addresses(slices: Iterable, port: int) -> list[str]:
    """HOST:PORT of every ready endpoint in these EndpointSlices (kubernetes client models)."""
    out = set()
    for s in slices:
        for ep in s.endpoints or ():
            conditions = ep.conditions
            if conditions is not None and conditions.ready is False:
                continue
            for addr in ep.addresses or ():
                out.add(f"[{addr}]:{port}" if ":" in addr else f"{addr}:{port}")
    return sorted(out)


class KubernetesDiscovery(Discovery):
    """Watches discovery.k8s.io/v1 EndpointSlices labelled kubernetes.io/service-name=SERVICE
    (the router's Role allows get/list/watch on them) from a background thread, started by the first
    addresses() call (parsing a flag starts nothing)."""

    dynamic = True

    def __init__(self, namespace: str, service: str, port: int) -> None:
        super().__init__([])
        self.namespace, self.service, self.port = namespace, service, port
        self._slices: dict[str, object] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    async def addresses(self) -> list[str]:
        if self._thread is None:  # the watch starts with the first question, not when the flag is parsed
            self._thread = threading.Thread(target=self._watch, daemon=True, name=f"k8s-watch-{self.service}")
            self._thread.start()
        with self._lock:
            return ready_addresses(list(self._slices.values()), self.port)

    def close(self) -> None:
        self._stop.set()

    def _watch(self) -> None:
        from kubernetes import client, config, watch

        selector = f"kubernetes.io/service-name={self.service}"
        api = None
        while not self._stop.is_set():
            try:
                if api is None:
                    try:
                        config.load_incluster_config()
                    except config.ConfigException:
                        config.load_kube_config()  # outside a cluster: KUBECONFIG / ~/.kube/config
                    api = client.DiscoveryV1Api()
                listing = api.list_namespaced_endpoint_slice(self.namespace, label_selector=selector)
                with self._lock:
                    self._slices = {s.metadata.name: s for s in listing.items}
                stream = watch.Watch().stream(api.list_namespaced_endpoint_slice, self.namespace,
                                              label_selector=selector, timeout_seconds=300,
                                              resource_version=listing.metadata.resource_version)
                for event in stream:
                    obj = event["object"]
                    with self._lock:
                        if event["type"] == "DELETED":
                            self._slices.pop(obj.metadata.name, None)
                        else:
                            self._slices[obj.metadata.name] = obj
                    if self._stop.is_set():
                        return
            except Exception as err:  # noqa: BLE001 - any API trouble: list again after a pause
                if self._stop.is_set():  # closed meanwhile: nothing to report
                    return
                log.warning("watching EndpointSlices of %s/%s: %s", self.namespace, self.service, err)
                self._stop.wait(5.0)


def parse_spec(spec: str) -> Discovery:
    """A --target / --draft value -> its Discovery. ValueError with a clear message when malformed."""
    try:
        if spec.startswith("dns:"):
            host, port = spec[4:].rsplit(":", 1)
            return DnsDiscovery(host, int(port))
        if spec.startswith("k8s:"):
            where, port = spec[4:].rsplit(":", 1)
            namespace, service = where.split("/", 1)
            return KubernetesDiscovery(namespace, service, int(port))
        addresses = [a.strip() for a in spec.split(",") if a.strip()]
        for a in addresses:
            int(a.rsplit(":", 1)[1])
        if not addresses:
            raise ValueError
        return Discovery(addresses)
    except (ValueError, IndexError):
        raise ValueError(f"{spec!r}: expected HOST:PORT[,HOST:PORT], dns:NAME:PORT or k8s:NAMESPACE/SERVICE:PORT") \
            from None
