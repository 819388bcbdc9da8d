import os

import pytest

from lightning_dltune.measurement.budget import (
    cpu_budget,
    default_max_workers,
    make_budget,
    read_affinity,
    read_cpu_quota,
)


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
    assert (b.cpus, b.bound_by) == (2.5, "cgroup v2 cpu.max")  # under the 16 CPUs of the affinity


def test_cgroup_v2_tightest_ancestor_wins(v2_tree):
    write(v2_tree, "sys/fs/cgroup/kubepods/pod1/ctr/cpu.max", "max 100000\n")
    write(v2_tree, "sys/fs/cgroup/kubepods/pod1/cpu.max", "400000 100000\n")
    write(v2_tree, "sys/fs/cgroup/kubepods/cpu.max", "800000 100000\n")
    assert read_cpu_quota(v2_tree)[0] == 4.0


def test_no_quota_means_affinity_bounds(v2_tree):
    b = cpu_budget(v2_tree)
    assert (b.cpus, b.bound_by) == (16.0, "affinity")


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
    assert b.bound_by.startswith(("affinity", "cgroup"))


@pytest.mark.parametrize(("cpus", "expected"), [(0.5, 4), (2, 16), (4, 32), (16, 64)])
def test_default_worker_ceiling_exceeds_the_cores_for_io(cpus, expected):
    assert default_max_workers(cpus) == expected


def test_user_cap_is_named_in_the_budget(v2_tree):
    b = make_budget(cpu_budget(v2_tree), max_workers=6, max_prefetch=4)
    assert (b.max_workers, b.max_prefetch) == (6, 4) and "max_workers=6" in b.bound_by


def test_memory_budget_from_meminfo(tmp_path):
    from lightning_dltune.measurement.budget import memory_budget

    write(tmp_path, "proc/meminfo", "MemTotal:       16000000 kB\nMemAvailable:    8000000 kB\n")
    b = memory_budget(tmp_path, fraction=0.5)
    assert b.available == 8000000 * 1024 and b.bytes == 4000000 * 1024 and b.cgroup_limit is None
    assert memory_budget(tmp_path, fraction=0.5, local_world_size=2).bytes == 2000000 * 1024


def test_cgroup_v2_memory_max_bounds_when_tighter(v2_tree):
    from lightning_dltune.measurement.budget import memory_budget

    write(v2_tree, "proc/meminfo", "MemAvailable:   64000000 kB\n")
    write(v2_tree, "sys/fs/cgroup/kubepods/pod1/ctr/memory.max", "max\n")
    write(v2_tree, "sys/fs/cgroup/kubepods/pod1/memory.max", str(4 * 2**30) + "\n")
    write(v2_tree, "sys/fs/cgroup/kubepods/pod1/memory.current", str(3 * 2**30) + "\n")
    b = memory_budget(v2_tree, fraction=1.0)
    assert b.bytes == 2**30 and b.cgroup_limit == 4 * 2**30 and "cgroup memory limit" in b.bound_by


def test_cgroup_v1_memory_limit(tmp_path):
    from lightning_dltune.measurement.budget import memory_budget

    write(tmp_path, "proc/self/cgroup", "5:memory:/docker/abc\n")
    write(tmp_path, "proc/meminfo", "MemAvailable:   64000000 kB\n")
    write(tmp_path, "sys/fs/cgroup/memory/docker/abc/memory.limit_in_bytes", str(2 * 2**30))
    write(tmp_path, "sys/fs/cgroup/memory/docker/abc/memory.usage_in_bytes", str(2**30))
    write(tmp_path, "sys/fs/cgroup/memory/memory.limit_in_bytes", str(2**63 - 4096))  # "no limit"
    assert memory_budget(tmp_path, fraction=1.0).bytes == 2**30


def test_shm_size_under_a_root(tmp_path):
    from lightning_dltune.measurement.budget import shm_free_bytes

    assert shm_free_bytes(tmp_path) is None  # no /dev/shm there
    (tmp_path / "dev" / "shm").mkdir(parents=True)
    assert shm_free_bytes(tmp_path) > 0


def test_real_machine_memory_and_shm():
    import psutil

    from lightning_dltune.measurement.budget import memory_budget, shm_free_bytes

    b = memory_budget()
    assert 0 < b.bytes <= psutil.virtual_memory().total
    shm = shm_free_bytes()
    assert shm is None or shm > 0


# --- container layouts (fake trees): page cache, per-rank cpusets, container roots, malformed files ---------


def test_cgroup_v2_page_cache_is_not_counted_as_used(v2_tree):
    from lightning_dltune.measurement.budget import memory_budget

    ctr = "sys/fs/cgroup/kubepods/pod1/ctr/"
    write(v2_tree, "proc/meminfo", "MemAvailable:   64000000 kB\n")
    write(v2_tree, ctr + "memory.max", str(8 * 2**30))
    write(v2_tree, ctr + "memory.current", str(8 * 2**30 - 4096))  # an I/O-heavy job: full of page cache
    write(v2_tree, ctr + "memory.stat", f"anon {2 * 2**30}\nfile {6 * 2**30}\ninactive_file {5 * 2**30}\n")
    assert memory_budget(v2_tree, fraction=1.0).bytes == 5 * 2**30 + 4096  # 8 GiB less the 3 GiB working set


def test_cgroup_v1_page_cache_is_not_counted_as_used(tmp_path):
    from lightning_dltune.measurement.budget import memory_budget

    write(tmp_path, "proc/self/cgroup", "5:memory:/docker/abc\n")
    write(tmp_path, "proc/meminfo", "MemAvailable:   64000000 kB\n")
    write(tmp_path, "sys/fs/cgroup/memory/docker/abc/memory.limit_in_bytes", str(4 * 2**30))
    write(tmp_path, "sys/fs/cgroup/memory/docker/abc/memory.usage_in_bytes", str(4 * 2**30))
    write(tmp_path, "sys/fs/cgroup/memory/docker/abc/memory.stat", f"cache 1\ntotal_inactive_file {3 * 2**30}\n")
    assert memory_budget(tmp_path, fraction=1.0).bytes == 3 * 2**30


def test_a_container_root_cgroup_is_read(tmp_path):
    """Inside a container the process sits at the namespace's root, "0::/": the limits are on the mount itself."""
    from lightning_dltune.measurement.budget import memory_budget

    write(tmp_path, "proc/self/cgroup", "0::/\n")
    write(tmp_path, "proc/self/status", "Cpus_allowed_list:\t0-31\n")
    write(tmp_path, "proc/meminfo", "MemAvailable:   64000000 kB\n")
    write(tmp_path, "sys/fs/cgroup/cgroup.controllers", "cpu memory\n")
    write(tmp_path, "sys/fs/cgroup/cpu.max", "400000 100000\n")
    write(tmp_path, "sys/fs/cgroup/memory.max", str(2 * 2**30))
    write(tmp_path, "sys/fs/cgroup/memory.current", str(2**30))
    assert (cpu_budget(tmp_path).cpus, cpu_budget(tmp_path).bound_by) == (4.0, "cgroup v2 cpu.max")
    assert memory_budget(tmp_path, fraction=1.0).bytes == 2**30


def test_a_rank_bound_to_its_own_cpus_is_not_divided_again(v2_tree):
    write(v2_tree, "sys/fs/cgroup/kubepods/pod1/ctr/cpuset.cpus.effective", "0-15\n")
    write(v2_tree, "proc/self/status", "Cpus_allowed_list:\t4-7\n")  # srun --cpu-bind: this rank's 4 CPUs
    b = cpu_budget(v2_tree, local_world_size=4)
    assert b.cpus == 4.0 and "this rank's own CPUs" in b.bound_by
    write(v2_tree, "proc/self/status", "Cpus_allowed_list:\t0-15\n")  # four ranks sharing the node's 16
    assert cpu_budget(v2_tree, local_world_size=4).cpus == 4.0
    write(v2_tree, "sys/fs/cgroup/kubepods/pod1/ctr/cpu.max", "800000 100000\n")  # a quota is the whole job's
    assert cpu_budget(v2_tree, local_world_size=4).cpus == 2.0


def test_cgroup_v1_cpuset_per_rank(tmp_path):
    write(tmp_path, "proc/self/cgroup", "6:cpuset:/slurm/job1\n4:cpu,cpuacct:/slurm/job1\n")
    write(tmp_path, "proc/self/status", "Cpus_allowed_list:\t0-1\n")
    write(tmp_path, "sys/fs/cgroup/cpuset/slurm/job1/cpuset.effective_cpus", "0-7\n")
    assert cpu_budget(tmp_path, local_world_size=4).cpus == 2.0


def test_no_cpu_limit_at_all(tmp_path):
    write(tmp_path, "proc/self/status", "Cpus_allowed_list:\t0-7\n")  # no cgroup files: a bare host
    b = cpu_budget(tmp_path, local_world_size=2)
    assert (b.cpus, b.bound_by) == (4.0, "affinity / 2 local ranks")


@pytest.mark.parametrize(
    ("rel", "text"),
    [
        ("sys/fs/cgroup/kubepods/pod1/ctr/cpu.max", "garbage\n"),
        ("sys/fs/cgroup/kubepods/pod1/ctr/cpu.max", "100000 zero\n"),
        ("sys/fs/cgroup/kubepods/pod1/ctr/cpuset.cpus.effective", "0-x,?\n"),
        ("sys/fs/cgroup/kubepods/pod1/ctr/memory.max", "lots\n"),
        ("sys/fs/cgroup/kubepods/pod1/ctr/memory.stat", "inactive_file many\n"),
        ("proc/self/status", "Cpus_allowed_list:\t0-\n"),
        ("proc/self/cgroup", "::::\n"),
        ("proc/meminfo", "MemAvailable:\n"),
    ],
)
def test_malformed_cgroup_files_never_raise(v2_tree, rel, text):
    from lightning_dltune.measurement.budget import memory_budget

    write(v2_tree, "sys/fs/cgroup/kubepods/pod1/ctr/memory.max", str(2**30))
    write(v2_tree, rel, text)
    assert cpu_budget(v2_tree, local_world_size=2).cpus >= 0.5
    assert memory_budget(v2_tree).bytes >= 0
