"""The pods' bridge, made and removed through the kernel's own ioctls (what brctl and ifconfig use), so the
node needs no `ip` command: a machine may have none (the GPU machine has no iproute2)."""

from __future__ import annotations

import contextlib
import fcntl
import ipaddress
import socket
import struct
from collections.abc import Iterator
from pathlib import Path

# linux/sockios.h
_SIOCBRADDBR = 0x89A0
_SIOCBRDELBR = 0x89A1
_SIOCGIFFLAGS = 0x8913
_SIOCSIFFLAGS = 0x8914
_SIOCSIFADDR = 0x8916
_SIOCSIFNETMASK = 0x891C
_IFF_UP = 0x1
_IFNAMSIZ = 16
SYS_NET = Path("/sys/class/net")


class LinkError(RuntimeError):
    """A bridge could not be made or removed; the message names the link and the kernel's reason."""


def _name(link: str) -> bytes:
    raw = link.encode()
    if not raw or len(raw) >= _IFNAMSIZ or b"/" in raw or b" " in raw:
        raise LinkError(f"{link!r} is not a valid interface name (1-15 bytes, no '/' or space)")
    return raw


def ifreq_flags(link: str, flags: int) -> bytes:
    """struct ifreq with ifr_flags: the name padded to IFNAMSIZ, then a short (the union is 24 bytes)."""
    return struct.pack(f"{_IFNAMSIZ}sH22x", _name(link), flags & 0xFFFF)


def ifreq_inet(link: str, address: str) -> bytes:
    """struct ifreq with an AF_INET sockaddr (ifr_addr / ifr_netmask), padded to the union's 24 bytes."""
    packed = socket.inet_aton(str(ipaddress.IPv4Address(address)))
    return struct.pack(f"{_IFNAMSIZ}sHH4s16x", _name(link), socket.AF_INET, 0, packed)


@contextlib.contextmanager
def _ioctl_socket() -> Iterator[socket.socket]:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        yield s


def _ioctl(s: socket.socket, request: int, arg: bytes, what: str) -> bytes:
    try:
        return fcntl.ioctl(s.fileno(), request, arg)
    except OSError as e:
        raise LinkError(f"{what}: {e.strerror}") from None


def exists(link: str) -> bool:
    return (SYS_NET / link).exists()


def add_bridge(link: str, address: str, prefix_len: int) -> None:
    """A bridge named ``link``, up, holding ``address/prefix_len``."""
    netmask = str(ipaddress.IPv4Network(f"0.0.0.0/{prefix_len}").netmask)
    with _ioctl_socket() as s:
        _ioctl(s, _SIOCBRADDBR, _name(link) + b"\0", f"add bridge {link}")
        _ioctl(s, _SIOCSIFADDR, ifreq_inet(link, address), f"set address {address} on {link}")
        _ioctl(s, _SIOCSIFNETMASK, ifreq_inet(link, netmask), f"set netmask {netmask} on {link}")
        _set_up(s, link, up=True)


def delete_bridge(link: str) -> None:
    """Remove the bridge ``link`` (brought down first, as the kernel requires); absent is fine."""
    if not exists(link):
        return
    with _ioctl_socket() as s:
        _set_up(s, link, up=False)
        _ioctl(s, _SIOCBRDELBR, _name(link) + b"\0", f"delete bridge {link}")


def _set_up(s: socket.socket, link: str, *, up: bool) -> None:
    current = _ioctl(s, _SIOCGIFFLAGS, ifreq_flags(link, 0), f"read flags of {link}")
    flags = int(struct.unpack_from("H", current, _IFNAMSIZ)[0])
    flags = flags | _IFF_UP if up else flags & ~_IFF_UP
    _ioctl(s, _SIOCSIFFLAGS, ifreq_flags(link, flags), f"set {link} {'up' if up else 'down'}")
