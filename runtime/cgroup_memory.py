"""How much memory this process's control group still lets it allocate: a container's limit, which /proc/meminfo
does not show (it reports the host's), so that a KV pool sized from it is not OOM-killed (kv_budget.py).

    cgroup v2   /proc/self/cgroup "0::/PATH"            ROOT/PATH/memory.max, memory.current, memory.stat
    cgroup v1   /proc/self/cgroup "N:...memory...:/PATH" ROOT/memory/PATH/memory.limit_in_bytes, memory.usage_in_bytes,
                                                         memory.stat
    room = limit - (usage - inactive file cache), the smallest over the cgroup and its ancestors

Inactive file cache is left out of the usage as the kernel reclaims it before it OOM-kills (the "working set" of
docker stats and the kubelet). Inside a container the PATH of /proc/self/cgroup may name a directory the
container cannot see; then the mounted root is the container's own cgroup. It knows nothing of engines.
"""
from __future__ import annotations

from pathlib import Path

UNLIMITED = 1 << 60          # v1 writes "no limit" as a page-rounded 2**63 - 1


def cgroup_room(proc_cgroup: Path = Path("/proc/self/cgroup"), root: Path = Path("/sys/fs/cgroup")) -> int | None:
    """Bytes this process's cgroups may still allocate; None when no memory limit applies (or none is readable)."""
    try:
        lines = proc_cgroup.read_text().splitlines()
    except OSError:
        return None
    rooms = []
    for line in lines:
        _, controllers, path = line.split(":", 2) if line.count(":") >= 2 else ("", "", "")
        if controllers == "" and path:                                 # v2, the unified hierarchy
            mount = root if (root / "cgroup.controllers").exists() else root / "unified"   # hybrid: v2 beside v1
            rooms.append(_room(mount, path, "memory.max", "memory.current", "inactive_file"))
        elif "memory" in controllers.split(","):                       # v1, the memory controller's own mount
            mount = next((p for p in (root / "memory", root / controllers) if p.is_dir()), None)
            if mount is not None:
                rooms.append(_room(mount, path, "memory.limit_in_bytes", "memory.usage_in_bytes",
                                   "total_inactive_file"))
    rooms = [r for r in rooms if r is not None]
    return min(rooms) if rooms else None


def _room(mount: Path, path: str, limit_file: str, usage_file: str, inactive_key: str) -> int | None:
    """The least room over the cgroup `path` under `mount` and its ancestors; None when none has a limit."""
    own = mount / path.strip("/")
    start = own if own.is_dir() else mount     # a host path the container cannot see: its root is its cgroup
    rooms = []
    for d in (start, *start.parents):
        limit = _read_int(d / limit_file)
        if limit is not None and limit < UNLIMITED:
            usage = _read_int(d / usage_file) or 0
            rooms.append(max(limit - max(usage - _stat(d / "memory.stat", inactive_key), 0), 0))
        if d == mount:
            break
    return min(rooms) if rooms else None


def _read_int(path: Path) -> int | None:
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None                  # "max": no limit


def _stat(path: Path, key: str) -> int:
    try:
        for line in path.read_text().splitlines():
            name, _, value = line.partition(" ")
            if name == key and value.strip().isdigit():
                return int(value)
    except OSError:
        pass
    return 0
