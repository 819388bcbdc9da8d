"""The resources the tuner may spend (:class:`Budget`), as measured: how many CPUs this training process may really
use (affinity, cgroup v2 ``cpu.max`` or the v1 CFS quota, divided among the training processes of the node), memory
and ``/dev/shm``. Every reader takes the filesystem root as a parameter so
tests can point it at a fake ``/proc`` and ``/sys/fs/cgroup`` tree."""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass, replace
from pathlib import Path

from lightning_dltune._warn import warn_once
from lightning_dltune.settings import LoaderSettings


@dataclass(frozen=True)
class Budget:
    """The resources the tuner may spend. ``cpus`` is what this training process may use (already divided
    among the local ranks); ``bound_by`` names the limit that set it, for the report."""

    cpus: float
    max_workers: int
    max_prefetch: int = 8
    bound_by: str = "affinity"
    memory_bytes: float | None = None  # what workers and pinned buffers may add
    shm_bytes: float | None = None  # free /dev/shm, where batches cross from workers to the trainer
    users_ceiling: bool = False  # ``max_workers`` is the user's: under DDP it is not pooled among a node's ranks


@dataclass(frozen=True)
class CpuBudget:
    """``cpus`` for one training process, and which limit set it."""

    cpus: float
    bound_by: str


def _read(path: Path) -> str | None:
    try:
        return path.read_text().strip()
    except OSError:
        return None


def _cgroup_paths(root: Path) -> dict[str, str]:
    """Map controller ("" for cgroup v2) -> this process's cgroup path, from ``/proc/self/cgroup``."""
    text = _read(root / "proc/self/cgroup") or ""
    out: dict[str, str] = {}
    for line in text.splitlines():
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        _, controllers, path = parts
        for c in controllers.split(",") if controllers else [""]:
            out[c] = path
    return out


def _ratio(quota: str, period: str) -> float | None:
    """``quota / period`` in CPUs; ``None`` for "max", -1 or a malformed file (a broken file never raises)."""
    try:
        q, p = int(quota), int(period)
    except ValueError:
        return None
    return q / p if q > 0 and p > 0 else None


def _ancestors(base: Path, cgroup_path: str) -> list[Path]:
    """The cgroup directory of this process and every parent up to the mount point, nearest first."""
    parts = [p for p in cgroup_path.strip("/").split("/") if p]
    dirs = [base.joinpath(*parts[:i]) for i in range(len(parts), -1, -1)]
    return [d for d in dirs if d.is_dir()]


def read_cpu_quota(root: str | os.PathLike[str] = "/") -> tuple[float | None, str | None]:
    """The tightest CPU quota (in CPUs) over this process's cgroup and its parents, and where it came from."""
    root = Path(root)
    cg = root / "sys/fs/cgroup"
    paths = _cgroup_paths(root)
    best: tuple[float | None, str | None] = (None, None)

    def consider(value: float, source: str) -> None:
        nonlocal best
        if value > 0 and (best[0] is None or value < best[0]):
            best = (value, source)

    if "" in paths and (cg / "cgroup.controllers").exists():  # cgroup v2
        for d in _ancestors(cg, paths[""]):
            text = _read(d / "cpu.max")
            if not text:
                continue
            quota, _, period = text.partition(" ")
            value = _ratio(quota, period or "100000")
            if value is not None:
                consider(value, "cgroup v2 cpu.max")
        return best
    for controller in ("cpu", "cpu,cpuacct", "cpuacct,cpu"):
        base = cg / controller
        if not base.is_dir():
            continue
        for d in _ancestors(base, paths.get("cpu", "/")):
            value = _ratio(_read(d / "cpu.cfs_quota_us") or "", _read(d / "cpu.cfs_period_us") or "")
            if value is not None:
                consider(value, "cgroup v1 cfs quota")
        break
    return best


def read_affinity(root: str | os.PathLike[str] = "/") -> int:
    """CPUs in this process's affinity mask (``Cpus_allowed_list`` under a fake root)."""
    root = Path(root)
    if root == Path("/") and hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    text = _read(root / "proc/self/status") or ""
    for line in text.splitlines():
        if line.startswith("Cpus_allowed_list:"):
            return _count_cpu_list(line.split(":", 1)[1].strip())
    return os.cpu_count() or 1


def _count_cpu_list(text: str) -> int:
    """CPUs in a list like ``0-3,8`` (at least 1; a malformed list counts what it can)."""
    n = 0
    for part in text.strip().split(","):
        lo, _, hi = part.strip().partition("-")
        try:
            n += int(hi) - int(lo) + 1 if hi else (1 if lo else 0)
        except ValueError:
            continue
    return max(1, n)


def read_cpuset(root: str | os.PathLike[str] = "/") -> int | None:
    """CPUs of this process's cgroup cpuset (what the container or job was given), ``None`` when unknown."""
    root = Path(root)
    cg = root / "sys/fs/cgroup"
    paths = _cgroup_paths(root)
    if "" in paths and (cg / "cgroup.controllers").exists():
        candidates = [d / "cpuset.cpus.effective" for d in _ancestors(cg, paths[""])]
    else:
        base = cg / "cpuset"
        dirs = _ancestors(base, paths.get("cpuset", "/")) if base.is_dir() else []
        candidates = [d / name for d in dirs for name in ("cpuset.effective_cpus", "cpuset.cpus")]
    for path in candidates:
        text = _read(path)
        if text:
            return _count_cpu_list(text)
    return None


def cpu_budget(root: str | os.PathLike[str] = "/", local_world_size: int = 1) -> CpuBudget:
    """CPUs one of ``local_world_size`` training processes on this node may use."""
    if local_world_size < 1:
        raise ValueError(f"`local_world_size` must be >= 1, got {local_world_size}.")
    affinity = read_affinity(root)
    quota, source = read_cpu_quota(root)
    cpuset = read_cpuset(root)
    # a rank bound to its own CPUs (SLURM --cpu-bind, numactl, torchrun's numa binding) already has its share
    own_cpus = local_world_size > 1 and cpuset is not None and affinity < cpuset
    by_affinity = float(affinity) if own_cpus else affinity / local_world_size
    by_quota = None if quota is None else quota / local_world_size  # a quota is the whole job's
    if by_quota is not None and by_quota < by_affinity:
        cpus, bound_by = by_quota, source or "cgroup"
    else:
        cpus, bound_by = by_affinity, "affinity" + (" (this rank's own CPUs)" if own_cpus else "")
    if local_world_size > 1 and not (own_cpus and bound_by.startswith("affinity")):
        bound_by += f" / {local_world_size} local ranks"
    return CpuBudget(cpus=max(cpus, 0.5), bound_by=bound_by)


MOST_WORKERS = 64  # the default ceiling's bound for one process, however many CPUs it has (or a node pools for it)


def default_max_workers(cpus: float) -> int:
    """Ceiling for I/O-bound loaders: 8 workers per CPU, at least 4, at most :data:`MOST_WORKERS`."""
    return max(4, min(MOST_WORKERS, int(8 * cpus)))


def make_budget(cpu: CpuBudget, max_workers: int | None, max_prefetch: int) -> Budget:
    cap = default_max_workers(cpu.cpus) if max_workers is None else max_workers
    bound_by = cpu.bound_by if max_workers is None else f"{cpu.bound_by}; max_workers={max_workers}"
    return Budget(cpu.cpus, cap, max_prefetch, bound_by, users_ceiling=max_workers is not None)


@dataclass(frozen=True)
class MemoryBudget:
    """Bytes the loader may add (workers' own memory and pinned buffers), and which limit set it."""

    bytes: float
    bound_by: str
    available: float
    cgroup_limit: float | None


def _read_int(path: Path) -> int | None:
    text = _read(path)
    if text is None or text in ("", "max"):
        return None
    try:
        return int(text)
    except ValueError:
        return None


def _stat(path: Path, key: str) -> int:
    """One counter of a ``memory.stat`` file (0 when absent or malformed)."""
    for line in (_read(path) or "").splitlines():
        name, _, value = line.partition(" ")
        if name == key:
            try:
                return int(value)
            except ValueError:
                return 0
    return 0


def read_mem_available(root: str | os.PathLike[str] = "/") -> float:
    """``MemAvailable`` from ``/proc/meminfo``, in bytes."""
    for line in (_read(Path(root) / "proc/meminfo") or "").splitlines():
        if line.startswith("MemAvailable:"):
            with contextlib.suppress(IndexError, ValueError):
                return float(line.split()[1]) * 1024
    import psutil

    return float(psutil.virtual_memory().available)


def read_cgroup_memory_headroom(root: str | os.PathLike[str] = "/") -> tuple[float | None, float | None]:
    """(limit, limit - current usage) of the tightest cgroup memory limit over this process's cgroups."""
    root = Path(root)
    cg = root / "sys/fs/cgroup"
    paths = _cgroup_paths(root)
    best: tuple[float | None, float | None] = (None, None)
    if "" in paths and (cg / "cgroup.controllers").exists():
        dirs, limit_file, usage_file = _ancestors(cg, paths[""]), "memory.max", "memory.current"
        cache_key = "inactive_file"
    else:
        base = cg / "memory"
        dirs = _ancestors(base, paths.get("memory", "/")) if base.is_dir() else []
        limit_file, usage_file, cache_key = "memory.limit_in_bytes", "memory.usage_in_bytes", "total_inactive_file"
    for d in dirs:
        limit = _read_int(d / limit_file)
        if limit is None or limit >= 2**60:  # v1 spells "no limit" as a huge number
            continue
        # the working set, as cAdvisor and the OOM killer see it: usage less the page cache it can reclaim
        usage = (_read_int(d / usage_file) or 0) - _stat(d / "memory.stat", cache_key)
        headroom = float(limit - max(0, usage))
        if best[1] is None or headroom < best[1]:
            best = (float(limit), headroom)
    return best


def memory_budget(root: str | os.PathLike[str] = "/", fraction: float = 0.5, local_world_size: int = 1) -> MemoryBudget:
    """``fraction`` of the memory this process could still take (free memory, or the cgroup's headroom when
    tighter), shared among the local training processes."""
    available = read_mem_available(root)
    limit, headroom = read_cgroup_memory_headroom(root)
    if headroom is not None and headroom < available:
        total, bound_by = headroom, "cgroup memory limit"
    else:
        total, bound_by = available, "available memory"
    return MemoryBudget(
        bytes=max(0.0, total) * fraction / max(1, local_world_size),
        bound_by=f"{fraction:.0%} of {bound_by}",
        available=available,
        cgroup_limit=limit,
    )


def shm_free_bytes(root: str | os.PathLike[str] = "/") -> float | None:
    """Free bytes of ``/dev/shm`` (where worker processes hand batches over), ``None`` when there is none."""
    path = Path(root) / "dev/shm"
    try:
        st = os.statvfs(path)
    except OSError:
        return None
    return float(st.f_bavail * st.f_frsize)


def tuner_budget(
    local_world_size: int, max_workers: int | None, max_prefetch: int, max_memory: float | None, root: str = "/"
) -> Budget:
    """The whole budget of one of ``local_world_size`` training processes: CPUs, worker ceiling, memory
    (``max_memory``: a fraction of what the process could still take, or bytes when > 1) and free /dev/shm."""
    budget = make_budget(cpu_budget(root, local_world_size=local_world_size), max_workers, max_prefetch)
    if max_memory is not None and max_memory > 1:
        memory, mem_bound = float(max_memory) / local_world_size, f"max_memory={max_memory:.0f} bytes"
    else:
        mem = memory_budget(root, fraction=float(max_memory or 0.5), local_world_size=local_world_size)
        memory, mem_bound = mem.bytes, mem.bound_by
    return replace(
        budget, memory_bytes=memory, shm_bytes=shm_free_bytes(root), bound_by=f"{budget.bound_by}; memory: {mem_bound}"
    )


def shm_warning(settings: LoaderSettings, batch_bytes: float, budget: Budget, fraction: float) -> str | None:
    """What to tell the user when ``settings``' batches in flight may not fit the free /dev/shm (else ``None``)."""
    shm = budget.shm_bytes
    if shm is None or batch_bytes <= 0 or settings.num_workers == 0:
        return None
    in_flight = batch_bytes * settings.batches_in_flight
    if in_flight <= fraction * shm:
        return None
    return (
        f"DataLoaderTuner: {settings.describe()} keeps about {in_flight / 2**20:.0f} MiB of batches in flight but "
        f"/dev/shm has {shm / 2**20:.0f} MiB free: workers may die with a bus error. Give the container more "
        "shared memory (docker run --shm-size=8g, or --ipc=host), or call "
        "torch.multiprocessing.set_sharing_strategy('file_system')."
    )


def warn_shm_risk(settings: LoaderSettings | None, batch_bytes: float, budget: Budget | None, fraction: float) -> None:
    """Warn once, with the fix, when ``settings``' batches in flight may not fit the free /dev/shm."""
    warning = None if settings is None or budget is None else shm_warning(settings, batch_bytes, budget, fraction)
    if warning:
        warn_once("shm-risk", warning)
