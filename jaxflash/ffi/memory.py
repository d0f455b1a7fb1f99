"""Host memory limits, read the way a container sees them.

/proc/meminfo describes the machine; a container (or a systemd slice) is usually held to less by its memory
cgroup. The expert pool is pinned (it can't be swapped or reclaimed), so pinning more than the cgroup allows
gets the process OOM-killed instead of failing cleanly. We therefore take the smallest of:
  * MemAvailable from /proc/meminfo,
  * for cgroup v2: memory.max - memory.current of this process's cgroup and every ancestor that sets a limit,
  * for cgroup v1: memory.limit_in_bytes - memory.usage_in_bytes of the memory controller's hierarchy.
Every reader takes the root directories as arguments so tests can point them at fake trees.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

GiB = 1 << 30
# cgroup v1 writes "no limit" as a huge page-rounded number (2^63 - 4096 on x86-64), not as "max".
_V1_UNLIMITED = 1 << 60


@dataclass(frozen=True)
class HostMemory:
    mem_total: int | None  # bytes; None where /proc/meminfo could not be read
    mem_available: int | None
    cgroup_version: int | None  # 1, 2, or None when no memory cgroup applies
    cgroup_limit: int | None  # the tightest limit on the way to the root; None when unlimited
    cgroup_usage: int | None

    @property
    def available(self) -> int | None:
        """Bytes this process can still take: the smaller of MemAvailable and the cgroup's headroom."""
        candidates = []
        if self.mem_available is not None:
            candidates.append(self.mem_available)
        if self.cgroup_limit is not None:
            candidates.append(max(0, self.cgroup_limit - (self.cgroup_usage or 0)))
        return min(candidates) if candidates else None

    def describe(self) -> str:
        parts = []
        if self.mem_available is not None:
            parts.append(f"MemAvailable {self.mem_available / GiB:.1f} GiB")
        if self.cgroup_limit is not None:
            parts.append(
                f"cgroup v{self.cgroup_version} limit {self.cgroup_limit / GiB:.1f} GiB "
                f"with {(self.cgroup_usage or 0) / GiB:.1f} GiB in use"
            )
        return ", ".join(parts) if parts else "no memory information"


def parse_meminfo(text: str) -> dict[str, int]:
    """/proc/meminfo as {field: bytes} (the kernel writes kB)."""
    out = {}
    for line in text.splitlines():
        name, _, rest = line.partition(":")
        fields = rest.split()
        if not fields:
            continue
        try:
            value = int(fields[0])
        except ValueError:
            continue
        out[name.strip()] = value * 1024 if len(fields) > 1 and fields[1] == "kB" else value
    return out


def parse_proc_cgroup(text: str) -> tuple[str | None, str | None]:
    """From /proc/<pid>/cgroup: (the cgroup v2 path, the cgroup v1 memory-controller path); None where absent."""
    v2 = v1 = None
    for line in text.splitlines():
        parts = line.strip().split(":", 2)
        if len(parts) != 3:
            continue
        hierarchy, controllers, path = parts
        if hierarchy == "0" and controllers == "":
            v2 = path
        elif "memory" in controllers.split(","):
            v1 = path
    return v2, v1


def _read_int(path: str, unlimited_above: int | None = None) -> int | None:
    """An integer file of cgroupfs; None when missing, unreadable, 'max' or past `unlimited_above`."""
    try:
        with open(path) as f:
            raw = f.read().strip()
    except OSError:
        return None
    if raw == "max" or not raw:
        return None
    try:
        value = int(raw)
    except ValueError:
        return None
    if unlimited_above is not None and value >= unlimited_above:
        return None
    return value


def _chain(root: str, path: str) -> list[str]:
    """Directories from the process's cgroup up to the mount root, the deepest first, keeping those that exist.

    Inside a cgroup namespace /proc/self/cgroup says "/" while the mount root already is our cgroup; in other
    setups the listed path may not exist under this mount. The root itself is always considered."""
    rel = path.strip("/")
    dirs = []
    while rel:
        d = os.path.join(root, rel)
        if os.path.isdir(d):
            dirs.append(d)
        rel = os.path.dirname(rel)
    dirs.append(root)
    return dirs


def cgroup_v2_limit(root: str, path: str) -> tuple[int | None, int | None]:
    """(tightest memory.max on the chain, memory.current of the deepest cgroup that reports it)."""
    limits, usage = [], None
    for d in _chain(root, path):
        lim = _read_int(os.path.join(d, "memory.max"))
        if lim is not None:
            limits.append(lim)
        if usage is None:
            usage = _read_int(os.path.join(d, "memory.current"))
    return (min(limits) if limits else None), usage


def cgroup_v1_limit(root: str, path: str) -> tuple[int | None, int | None]:
    """The same for the v1 memory controller mounted at `root` (e.g. /sys/fs/cgroup/memory)."""
    limits, usage = [], None
    for d in _chain(root, path):
        lim = _read_int(os.path.join(d, "memory.limit_in_bytes"), unlimited_above=_V1_UNLIMITED)
        if lim is not None:
            limits.append(lim)
        if usage is None:
            usage = _read_int(os.path.join(d, "memory.usage_in_bytes"))
    return (min(limits) if limits else None), usage


def read_host_memory(proc: str = "/proc", cgroup_root: str = "/sys/fs/cgroup", pid: str = "self") -> HostMemory:
    try:
        with open(os.path.join(proc, "meminfo")) as f:
            info = parse_meminfo(f.read())
    except OSError:
        info = {}
    try:
        with open(os.path.join(proc, pid, "cgroup")) as f:
            v2_path, v1_path = parse_proc_cgroup(f.read())
    except OSError:
        v2_path = v1_path = None

    version = limit = usage = None
    v1_root = os.path.join(cgroup_root, "memory")
    if v1_path is not None and os.path.isdir(v1_root):
        limit, usage = cgroup_v1_limit(v1_root, v1_path)
        version = 1
    elif v2_path is not None and os.path.exists(os.path.join(cgroup_root, "cgroup.controllers")):
        limit, usage = cgroup_v2_limit(cgroup_root, v2_path)
        version = 2
    return HostMemory(
        mem_total=info.get("MemTotal"),
        mem_available=info.get("MemAvailable"),
        cgroup_version=version,
        cgroup_limit=limit,
        cgroup_usage=usage,
    )


def pinning_fits(nbytes: int, memory: HostMemory, headroom: int | None = None) -> tuple[bool, str]:
    """Whether `nbytes` can be pinned while leaving `headroom` (default: 2 GiB or 5% of the available memory,
    the larger) for everything else. Returns (fits, reason when it does not)."""
    available = memory.available
    if available is None:
        return True, ""
    if headroom is None:
        headroom = max(2 * GiB, available // 20)
    if nbytes + headroom <= available:
        return True, ""
    return False, (
        f"pinning {nbytes / GiB:.2f} GiB would leave less than {headroom / GiB:.1f} GiB of the "
        f"{available / GiB:.1f} GiB available ({memory.describe()})"
    )
