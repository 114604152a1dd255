"""Who reaches whom, and how: direct inside a datacenter, via the WAN relay
between datacenters. Each WAN link's relay exposes every instance of its far
datacenter (`b`) on two ports: HTTP at base + 2k, KV at base + 2k + 1."""

from __future__ import annotations

from dataclasses import dataclass

from pdd.deploy.spec import DeploymentSpec, InstanceSpec, LinkSpec, Role


@dataclass(frozen=True)
class Address:
    host: str
    port: int        # HTTP API
    kv_port: int     # KV receiver
    link: str        # "local" or "wan"

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"


def far_side(spec: DeploymentSpec, link: LinkSpec) -> list[InstanceSpec]:
    return [i for i in spec.instances if i.datacenter == link.b]


def address(spec: DeploymentSpec, inst: InstanceSpec, from_dc: str) -> Address:
    if from_dc == inst.datacenter:
        return Address(inst.host, inst.port, inst.kv_port, "local")
    link = spec.link_between(from_dc, inst.datacenter)
    if link is None or link.b != inst.datacenter:
        raise ValueError(f"no WAN link from {from_dc!r} into {inst.datacenter!r} for {inst.name!r}")
    http, kv = _relay_ports(link, far_side(spec, link).index(inst))
    return Address(link.relay_host, http, kv, "wan")


def _relay_ports(link: LinkSpec, k: int) -> tuple[int, int]:
    """The relay's (HTTP, KV) ports for the k-th instance of the far side."""
    return link.relay_port_base + 2 * k, link.relay_port_base + 2 * k + 1


def relay_mappings(spec: DeploymentSpec, link: LinkSpec) -> list[tuple[int, str, int]]:
    """(listen_port, target_host, target_port) for the link's relay."""
    out = []
    for k, inst in enumerate(far_side(spec, link)):
        http, kv = _relay_ports(link, k)
        out.append((http, inst.host, inst.port))
        out.append((kv, inst.host, inst.kv_port))
    return out


def control_ports(spec: DeploymentSpec, link: LinkSpec) -> set[int]:
    """The relay's ports that carry the instances' HTTP (control calls, token
    streams), not their KV."""
    return {_relay_ports(link, k)[0] for k in range(len(far_side(spec, link)))}


def copy_pace(spec: DeploymentSpec) -> dict[str, float]:
    """Per line label, the rate at which each P writes the copies that yield
    that line (`pdd.policy.line_order.copy_pace_bytes_s`): the WAN's rate
    (there is one WAN line, "wan") shared by the deployment's prefill
    instances. Empty: nothing is paced. The servers' senders take it from
    here; the simulator's line calls the same policy function with its own
    count of P instances (`sim.cluster`: scenario files have no deployment)."""
    from pdd.policy.config import PolicyConfig
    from pdd.policy.line_order import copy_pace_bytes_s

    if not spec.links:
        return {}
    senders = sum(1 for i in spec.instances if i.role == Role.PREFILL)
    pace = copy_pace_bytes_s(spec.links[0].bandwidth_mbps * 125_000, senders,
                             PolicyConfig.from_dict(spec.policy).copy_pace)
    return {} if pace is None else {"wan": pace}
