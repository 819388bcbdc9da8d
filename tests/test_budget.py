import os

import pytest

from lightning_dltune.budget import cpu_budget, default_max_workers, make_budget, read_affinity, read_cpu_quota


def write(root, rel, text):
    path = root / rel
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


@pytest.fixture
def v2_tree(tmp_path):
    write(tmp_path, "proc/self/cgroup", "0::/kubepods/pod1/ctr\n")
    write(tmp_path, "proc/self/status", "Name:\tpython\nCpus_allowed_list:\t0-15\n")
    write(tmp_path, "sys/fs/cgroup/cgroup.controllers", "cpu memory\n")
    write(tmp_path, "sys/fs/cgroup/cpu.max", "max 100000\n")
    return tmp_path


def test_cgroup_v2_quota_of_the_process_cgroup(v2_tree):
    write(v2_tree, "sys/fs/cgroup/kubepods/pod1/ctr/cpu.max", "250000 100000\n")
    assert read_cpu_quota(v2_tree) == (2.5, "cgroup v2 cpu.max")
    b = cpu_budget(v2_tree)
    assert (b.cpus, b.affinity, b.bound_by) == (2.5, 16, "cgroup v2 cpu.max")


def test_cgroup_v2_tightest_ancestor_wins(v2_tree):
    write(v2_tree, "sys/fs/cgroup/kubepods/pod1/ctr/cpu.max", "max 100000\n")
    write(v2_tree, "sys/fs/cgroup/kubepods/pod1/cpu.max", "400000 100000\n")
    write(v2_tree, "sys/fs/cgroup/kubepods/cpu.max", "800000 100000\n")
    assert read_cpu_quota(v2_tree)[0] == 4.0


def test_no_quota_means_affinity_bounds(v2_tree):
    b = cpu_budget(v2_tree)
    assert (b.cpus, b.bound_by, b.quota) == (16.0, "affinity", None)


def test_cgroup_v1_cfs_quota(tmp_path):
    write(tmp_path, "proc/self/cgroup", "4:cpu,cpuacct:/docker/abc\n3:memory:/docker/abc\n")
    write(tmp_path, "proc/self/status", "Cpus_allowed_list:\t0-7\n")
    write(tmp_path, "sys/fs/cgroup/cpu,cpuacct/docker/abc/cpu.cfs_quota_us", "150000\n")
    write(tmp_path, "sys/fs/cgroup/cpu,cpuacct/docker/abc/cpu.cfs_period_us", "100000\n")
    write(tmp_path, "sys/fs/cgroup/cpu,cpuacct/cpu.cfs_quota_us", "-1\n")
    write(tmp_path, "sys/fs/cgroup/cpu,cpuacct/cpu.cfs_period_us", "100000\n")
    b = cpu_budget(tmp_path)
    assert (b.cpus, b.bound_by) == (1.5, "cgroup v1 cfs quota")


def test_affinity_list_parsing(tmp_path):
    write(tmp_path, "proc/self/status", "Cpus_allowed_list:\t0-3,8,10-11\n")
    assert read_affinity(tmp_path) == 7


def test_local_ranks_share_the_node(v2_tree):
    b = cpu_budget(v2_tree, local_world_size=4)
    assert b.cpus == 4.0 and b.bound_by == "affinity / 4 local ranks"
    with pytest.raises(ValueError, match="`local_world_size` must be >= 1"):
        cpu_budget(v2_tree, local_world_size=0)


def test_real_machine_budget_is_within_the_affinity():
    b = cpu_budget()
    assert 0.5 <= b.cpus <= len(os.sched_getaffinity(0))
    assert b.affinity == len(os.sched_getaffinity(0))


@pytest.mark.parametrize(("cpus", "expected"), [(0.5, 4), (2, 16), (4, 32), (16, 64)])
def test_default_worker_ceiling_exceeds_the_cores_for_io(cpus, expected):
    assert default_max_workers(cpus) == expected


def test_user_cap_is_named_in_the_budget(v2_tree):
    b = make_budget(cpu_budget(v2_tree), max_workers=6, max_prefetch=4)
    assert (b.max_workers, b.max_prefetch) == (6, 4) and "max_workers=6" in b.bound_by


def test_memory_budget_from_meminfo(tmp_path):
    from lightning_dltune.budget import memory_budget

    write(tmp_path, "proc/meminfo", "MemTotal:       16000000 kB\nMemAvailable:    8000000 kB\n")
    b = memory_budget(tmp_path, fraction=0.5)
    assert b.available == 8000000 * 1024 and b.bytes == 4000000 * 1024 and b.cgroup_limit is None
    assert memory_budget(tmp_path, fraction=0.5, local_world_size=2).bytes == 2000000 * 1024


def test_cgroup_v2_memory_max_bounds_when_tighter(v2_tree):
    from lightning_dltune.budget import memory_budget

    write(v2_tree, "proc/meminfo", "MemAvailable:   64000000 kB\n")
    write(v2_tree, "sys/fs/cgroup/kubepods/pod1/ctr/memory.max", "max\n")
    write(v2_tree, "sys/fs/cgroup/kubepods/pod1/memory.max", str(4 * 2**30) + "\n")
    write(v2_tree, "sys/fs/cgroup/kubepods/pod1/memory.current", str(3 * 2**30) + "\n")
    b = memory_budget(v2_tree, fraction=1.0)
    assert b.bytes == 2**30 and b.cgroup_limit == 4 * 2**30 and "cgroup memory limit" in b.bound_by


def test_cgroup_v1_memory_limit(tmp_path):
    from lightning_dltune.budget import memory_budget

    write(tmp_path, "proc/self/cgroup", "5:memory:/docker/abc\n")
    write(tmp_path, "proc/meminfo", "MemAvailable:   64000000 kB\n")
    write(tmp_path, "sys/fs/cgroup/memory/docker/abc/memory.limit_in_bytes", str(2 * 2**30))
    write(tmp_path, "sys/fs/cgroup/memory/docker/abc/memory.usage_in_bytes", str(2**30))
    write(tmp_path, "sys/fs/cgroup/memory/memory.limit_in_bytes", str(2**63 - 4096))  # "no limit"
    assert memory_budget(tmp_path, fraction=1.0).bytes == 2**30


def test_shm_size_under_a_root(tmp_path):
    from lightning_dltune.budget import shm_free_bytes

    assert shm_free_bytes(tmp_path) is None  # no /dev/shm there
    (tmp_path / "dev" / "shm").mkdir(parents=True)
    assert shm_free_bytes(tmp_path) > 0


def test_real_machine_memory_and_shm():
    import psutil

    from lightning_dltune.budget import memory_budget, shm_free_bytes

    b = memory_budget()
    assert 0 < b.bytes <= psutil.virtual_memory().total
    shm = shm_free_bytes()
    assert shm is None or shm > 0
