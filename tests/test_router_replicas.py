"""Several target and draft replicas behind one router: sequences pinned and spread, a lost
replica's sequences finished on another by recompute. Plus replica discovery specs."""

from __future__ import annotations

import asyncio
import concurrent.futures as cf

import pytest
from kubernetes.client import DiscoveryV1EndpointPort, V1Endpoint, V1EndpointConditions, V1EndpointSlice

from router.config import RouterConfig
from router.discovery import Discovery, DnsDiscovery, KubernetesDiscovery, parse_spec, ready_addresses
from tests.conftest import hf_greedy
from tests.stack import complete, start_draft, start_router, start_target, wait_until
from tests.test_router_integration import metric, prompts


def per_replica(url: str, name: str) -> dict[str, float]:
    import httpx

    out = {}
    for line in httpx.get(f"{url}/metrics").text.splitlines():
        if line.startswith(name + "{"):
            replica = line.split('replica="', 1)[1].split('"', 1)[0]
            out[replica] = float(line.rsplit(" ", 1)[1])
    return out


def test_two_targets_two_drafts_spread_and_survive_a_lost_replica(model_pair):
    target_dir, draft_dir = model_pair
    targets = [start_target(target_dir) for _ in range(2)]
    drafts = [start_draft(draft_dir) for _ in range(2)]
    spec_t = ",".join(t.address for t, _ in targets)
    spec_d = ",".join(d.address for d, _ in drafts)
    # a fixed k: the draft replicas work from the first step (with dynamic k, on the cores they share with
    # the targets, they would rest until measured to pay: router.regime)
    router = start_router(RouterConfig(max_num_batched_tokens=64, max_num_seqs=16, target_grace_s=30, dynamic_k=False),
                          spec_t, spec_d, target_dir)
    try:
        ps = prompts(32)
        with cf.ThreadPoolExecutor(32) as pool:
            outs = list(pool.map(lambda p: complete(router.url, p, 16), ps))
        for p, out in zip(ps, outs, strict=True):
            assert out["choices"][0]["token_ids"] == hf_greedy(target_dir, p, 16)
        assigned = per_replica(router.url, "tandem:replica_sequences_total")
        assert set(assigned) == {t.address for t, _ in targets}
        assert min(assigned.values()) >= 8, f"load not spread: {assigned}"
        assert all(r.forward_calls > 0 for _, r in targets) and all(r.forward_calls > 0 for _, r in drafts)

        # one target replica dies mid-load: its sequences finish on the other, correctly
        ps = prompts(12)
        with cf.ThreadPoolExecutor(12) as pool:
            futures = [pool.submit(complete, router.url, p, 120) for p in ps]
            assert wait_until(lambda: metric(router.url, "tandem:generation_tokens_total") > 16 * 32 + 60, 60)
            targets[0][0].stop(timeout=15)
            outs = [f.result(timeout=180) for f in futures]
        for p, out in zip(ps, outs, strict=True):
            assert out["choices"][0]["token_ids"] == hf_greedy(target_dir, p, 120)
        assert metric(router.url, "tandem:replica_migrations_total") > 0
        up = per_replica(router.url, "tandem:replica_up")
        assert up[targets[0][0].address] == 0 and up[targets[1][0].address] == 1
        # new requests all go to the live replica
        out = complete(router.url, ps[0], 8)
        assert out["choices"][0]["token_ids"] == hf_greedy(target_dir, ps[0], 8)
    finally:
        router.stop()
        for s, _ in targets + drafts:
            if s.thread.is_alive():
                s.stop()


def test_specs_parse_or_explain():
    assert isinstance(parse_spec("a:1,b:2"), Discovery)
    assert asyncio.run(parse_spec("a:1, b:2").addresses()) == ["a:1", "b:2"]
    dns = parse_spec("dns:localhost:50052")
    assert isinstance(dns, DnsDiscovery) and (dns.name, dns.port) == ("localhost", 50052)
    for bad in ("", "nohost", "a:notaport", "dns:nameonly", "k8s:noslash:1"):
        with pytest.raises(ValueError, match="expected HOST:PORT"):
            parse_spec(bad)


def test_dns_discovery_resolves_every_address():
    addresses = asyncio.run(DnsDiscovery("localhost", 50052).addresses())
    assert "127.0.0.1:50052" in addresses
    assert asyncio.run(DnsDiscovery("no-such-host.invalid", 1).addresses()) == []


def test_endpoint_slices_give_ready_addresses_only():
    def endpoint(addr: str, ready: bool | None) -> V1Endpoint:
        return V1Endpoint(addresses=[addr], conditions=V1EndpointConditions(ready=ready))

    slices = [
        V1EndpointSlice(address_type="IPv4", endpoints=[endpoint("10.0.0.1", True), endpoint("10.0.0.2", False)],
                        ports=[DiscoveryV1EndpointPort(port=50052)]),
        V1EndpointSlice(address_type="IPv4", endpoints=[endpoint("10.0.0.3", None)]),
        V1EndpointSlice(address_type="IPv6", endpoints=[endpoint("fd00::7", True)]),
        V1EndpointSlice(address_type="IPv4", endpoints=None),
    ]
    assert ready_addresses(slices, 50052) == ["10.0.0.1:50052", "10.0.0.3:50052", "[fd00::7]:50052"]


def test_kubernetes_spec_outside_a_cluster_keeps_trying_without_crashing():
    disc = KubernetesDiscovery("tandem", "target", 50052)  # no in-cluster credentials here
    try:
        assert asyncio.run(disc.addresses()) == []
    finally:
        disc.close()
