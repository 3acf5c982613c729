"""Network interfaces: the IPv4 address of an interface named by the user (``SPARK_HVD_IFACE``,
Horovod's ``HOROVOD_GLOO_IFACE``, ``--network-interface``, ``nics=``), for a rank to listen on and
advertise instead of the address its launcher saw."""

from __future__ import annotations

import socket
import struct
import sys
from typing import Dict, Optional, Sequence

__all__ = ["interface_addresses", "interface_address", "advertised_address", "WILDCARD_ADDRESSES"]

WILDCARD_ADDRESSES = frozenset({"", "0.0.0.0", "::", "[::]", "*"})
"""Addresses that mean every interface: a rank never listens on or advertises one."""

_SIOCGIFADDR = 0x8915


def _address_of(name: str) -> Optional[str]:
    if not sys.platform.startswith("linux"):
        return None
    import fcntl

    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        try:
            packed = fcntl.ioctl(probe.fileno(), _SIOCGIFADDR, struct.pack("256s", name.encode()[:15]))
        except OSError:  # no IPv4 address on it (down, or IPv6 only)
            return None
    return socket.inet_ntoa(packed[20:24])


def interface_addresses() -> Dict[str, str]:
    """IPv4 address of every interface of this host that has one, by interface name."""
    found: Dict[str, str] = {}
    for _, name in socket.if_nameindex():
        address = _address_of(name)
        if address is not None:
            found[name] = address
    return found


def interface_address(names: Sequence[str]) -> str:
    """The IPv4 address of the first of ``names`` that this host has; a ValueError naming the
    interfaces there are when none of them is."""
    wanted = [n.strip() for n in names if n and n.strip()]
    if not wanted:
        raise ValueError("no network interface named: expected one or more names such as 'eth0'")
    for name in wanted:
        address = _address_of(name)
        if address is not None:
            return address
    there = interface_addresses()
    listing = ", ".join(f"{n} ({a})" for n, a in sorted(there.items())) or "none with an IPv4 address"
    raise ValueError(f"network interface(s) {wanted} not found with an IPv4 address on host {socket.gethostname()}; "
                     f"this host has: {listing}; fix: name one of those (SPARK_HVD_IFACE, nics=...)")


def advertised_address(hostname: str, iface: Optional[str] = None) -> str:
    """The address a rank listens on and gives its peers: that of the first interface named in
    ``iface`` (comma-separated, ``SPARK_HVD_IFACE``) that this host has, else ``hostname``
    (``SPARK_HVD_HOSTNAME``, which the launcher sets to the address it knows the host by)."""
    if iface is not None and iface.strip():
        return interface_address(iface.split(","))
    if hostname.strip() in WILDCARD_ADDRESSES:
        raise ValueError(f"SPARK_HVD_HOSTNAME={hostname!r} is a wildcard address, which peers cannot dial: expected "
                         "this host's own address or name; fix: set SPARK_HVD_HOSTNAME to it, or name an interface "
                         "with SPARK_HVD_IFACE")
    return hostname
