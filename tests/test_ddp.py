import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from torch.utils.data import DistributedSampler

from lightning_dltune.output.cache import TuningCache

SCRIPT = Path(__file__).with_name("ddp_script.py")
N, BATCH = 384, 16


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def env(**extra: str) -> dict[str, str]:
    e = {k: v for k, v in os.environ.items() if not k.startswith(("LOCAL_RANK", "NODE_RANK", "WORLD_SIZE", "MASTER_"))}
    e.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), PYTHONUNBUFFERED="1", **extra)
    return e


def read(out: Path, world: int = 2) -> list[dict]:
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(world)]


def expected_order(rank: int, epoch: int, seed: int, world: int = 2) -> list[int]:
    sampler = DistributedSampler(range(N), num_replicas=world, rank=rank, shuffle=True, seed=seed)
    sampler.set_epoch(epoch)
    return list(sampler)


def check_agreement_and_shards(results: list[dict], out: Path) -> None:
    world, first = len(results), results[0]
    # the report at its default place, written once, by rank zero, after every rank read the log dir together
    assert first["report_file"] == str(out / "dltune_report.json")
    assert all(r["report_file"] is None for r in results[1:])
    assert [p.name for p in out.rglob("dltune_report.json")] == ["dltune_report.json"]
    assert json.loads((out / "dltune_report.json").read_text())["world_size"] == world
    for key in ("phase", "best_settings", "trials", "decisions"):
        assert all(r[key] == first[key] for r in results), key  # every rank settled identically
    assert all(r["world_size"] == world for r in results)
    assert first["best_settings"]["num_workers"] > 0
    assert len(first["trials"]) >= 2  # the loader was rebuilt at least once
    assert first["stall_spread"] is not None
    for r in results:
        assert r["sampler"] == "DistributedSampler"
        assert r["sampler_epochs"] == list(range(len(r["epochs"])))  # epoch-seeded after every rebuild
        for epoch, seen in enumerate(r["epochs"]):
            assert seen == expected_order(r["rank"], epoch, r["seed"], world), f"rank {r['rank']} epoch {epoch}"
    for epoch in range(len(first["epochs"])):
        assert sorted(i for r in results for i in r["epochs"][epoch]) == list(range(N))  # exact and disjoint
    # every rank reloads when some rank's count changes (Lightning's reload is a collective); a rank whose count stayed
    # went on with its loader: the same worker processes (in the runs where some rank's count stayed)
    for r in results:
        counts, pids = r["workers_per_epoch"], r["pids_per_epoch"]
        for e in range(1, len(counts)):
            if counts[e] == counts[e - 1] > 0:
                assert pids[e] == pids[e - 1] and len(pids[e]) == counts[e], (r["rank"], e, pids)


def run_logged(cmd: list[str], log: Path, **kwargs) -> subprocess.Popen:
    """Output to a file, not a pipe: an undrained pipe blocks a chatty rank while the others wait for it."""
    with log.open("w") as fh:
        return subprocess.Popen(cmd, stdout=fh, stderr=subprocess.STDOUT, **kwargs)


@pytest.mark.parametrize("mode", ["epoch", "in_epoch"])
def test_two_processes_agree_without_hanging(tmp_path, mode):
    log = tmp_path / "ddp.log"
    proc = run_logged([sys.executable, str(SCRIPT), str(tmp_path), "single", mode], log, env=env())
    assert proc.wait(timeout=150) == 0, log.read_text()[-3000:]
    results = read(tmp_path)
    check_agreement_and_shards(results, tmp_path)
    # rank 1's samples take 6x as long: every rank keeps each rank's stall, and at 0 workers rank 1 waits most
    first = results[0]["trial_ranks"][0]
    assert all(r["trial_ranks"] == results[0]["trial_ranks"] for r in results)
    assert len(first) == 2 and first[1] > first[0] + 0.2, results[0]["trial_ranks"]
    # the decisions were agreed (sized on rank 1); once tuning ended, rank 0 runs the fewer workers its own windows
    # ask for, rank 1 at most the agreed count, and every epoch's shard above is still exact on both
    r0, r1 = results
    # rank 0 launched rank 1 (Lightning's subprocess launcher): its workers' CPU leaves rank 1's process tree out
    assert r0["cpu_apart"] == [r1["pid"]] and r1["cpu_apart"] == []
    counts = r0["rank_workers"]
    assert r1["rank_workers"] == counts and len(counts) == 2 and counts[0] < counts[1], counts
    assert r1["running"]["num_workers"] == counts[1] <= r1["best_settings"]["num_workers"]
    assert r0["running"]["num_workers"] == counts[0] and r0["alike"] is None
    # the share followed need: rank 1 (96 ms of waiting a batch against a 5 ms step: more than 16 workers' worth)
    # took what rank 0 left of the node's worker ceiling, within the node's total
    share = r0["own_max_workers"]
    assert counts[1] > share or share >= 16, (counts, share)
    assert sum(counts) <= 2 * share, (counts, share)
    assert json.loads((tmp_path / "dltune_report.json").read_text())["rank_workers"] == counts
    # each rank taught the cache its own entry (the agreed settings, its own count), keyed by its rank
    entries = [e for e in TuningCache(tmp_path / "dltune_cache.json").entries() if "loop" not in e["fields"]["limits"]]
    assert sorted((e["fields"]["rank"], e["own_workers"]) for e in entries) == [(0, counts[0]), (1, counts[1])]
    assert all(e["settings"] == r1["best_settings"] for e in entries)
    # validation: each rank's DistributedSampler shard (unshuffled), in order, at every pass (the sanity check's 2
    # batches first) as an untuned run has it; its loader's configs agreed on both ranks, the tuner's after the first
    for r in results:
        shard = [list(range(r["rank"], 160, 2))[i : i + 16] for i in range(0, 80, 16)]
        assert r["val_seen"] == shard[:2] + shard * 3
    assert results[0]["val_trials"] == results[1]["val_trials"]
    assert results[0]["val_trials"][0]["num_workers"] == 0 and len(results[0]["val_trials"]) > 1
    if mode == "in_epoch":  # windows of 5 steps in 12-step epochs: the loader changed inside an epoch
        assert min(results[0]["steps_per_trial"]) < 12
        # seamless epochs (on by default: a DistributedSampler's order is known ahead) carried the iterator into a
        # later epoch on every rank, and each shard above is still exactly its epoch's, with dropout in the step
        assert all(r["carried"] >= 1 for r in results), [r["carried"] for r in results]


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs 2 CPUs to give the nodes different budgets")
def test_two_nodes_of_two_processes_on_loopback_each_compute_a_budget_and_agree(tmp_path):
    common = env(WORLD_SIZE="4")
    logs = [tmp_path / f"node{i}.log" for i in range(2)]
    cmd = [sys.executable, str(SCRIPT), str(tmp_path), "node"]
    procs = [run_logged(cmd, log, env={**common, "NODE_RANK": str(i)}) for i, log in enumerate(logs)]
    codes = [p.wait(timeout=200) for p in procs]
    assert codes == [0, 0], [log.read_text()[-2000:] for log in logs]
    results = read(tmp_path, world=4)
    assert [r["own_cpus"] for r in results] == [len(os.sched_getaffinity(0))] * 2 + [1, 1]  # node 1 has fewer
    check_agreement_and_shards(results, tmp_path)
    agreed = {r["agreed_cpus"] for r in results}
    assert len(agreed) == 1 and agreed.pop() <= 1.0  # the tightest node governs every rank


def test_a_worker_dying_on_one_rank_makes_every_rank_fall_back_to_the_same_config(tmp_path):
    log = tmp_path / "ddp.log"
    proc = run_logged([sys.executable, str(SCRIPT), str(tmp_path), "kill", "in_epoch"], log, env=env())
    assert proc.wait(timeout=150) == 0, log.read_text()[-3000:]
    a, b = read(tmp_path)
    # rank 1 recovered alone at once; at the next decision point both ranks recorded it and settled together
    assert a["trials"] == b["trials"] and a["failed"] == b["failed"] and any(a["failed"])
    assert a["best_settings"] == b["best_settings"] and a["best_settings"]["num_workers"] != 2
    assert a["phase"] == b["phase"] == "settled" and a["settled_step"] == b["settled_step"] is not None
    for r in (a, b):
        for epoch, seen in enumerate(r["epochs"]):
            assert seen == expected_order(r["rank"], epoch, r["seed"]), f"rank {r['rank']} epoch {epoch}"


def test_a_mid_epoch_checkpoint_resumes_every_ranks_own_shard_exactly(tmp_path):
    head, tail = tmp_path / "head", tmp_path / "tail"
    for out in (head, tail):
        out.mkdir()
    cmd = [sys.executable, str(SCRIPT)]
    proc = run_logged([*cmd, str(head), "head", "in_epoch"], head / "ddp.log", env=env())
    assert proc.wait(timeout=150) == 0, (head / "ddp.log").read_text()[-3000:]
    (ckpt,) = (head / "ckpt").glob("*.ckpt")
    proc = run_logged([*cmd, str(tail), "tail", "in_epoch", str(ckpt)], tail / "ddp.log", env=env())
    assert proc.wait(timeout=150) == 0, (tail / "ddp.log").read_text()[-3000:]
    for before, after in zip(read(head), read(tail), strict=True):
        rank, seed = before["rank"], before["seed"]
        assert len(before["by_epoch"]["2"]) == 6 * BATCH  # stopped at batch 6 of epoch 2
        epoch2 = before["by_epoch"]["2"] + after["by_epoch"]["2"]
        assert epoch2 == expected_order(rank, 2, seed), f"rank {rank}: epoch 2 across the restart"
        assert after["by_epoch"]["3"] == expected_order(rank, 3, seed)
    # rank 1 loads at a sixth of rank 0's pace: tuning ended before the checkpoint with each rank on its own count,
    # and the resumed run gave each rank its own back (from the checkpoint rank zero saved). That the counts differ is
    # test_two_processes_agree_without_hanging's: here, with 2 ranks and their workers on 2 CPUs, a trial's gain can
    # read as noise and both ranks settle on one count, which the resume must give back just the same
    head0 = read(head)[0]
    counts = head0["rank_workers"]
    assert head0["phase"] == "settled" and len(counts) == 2 and counts[0] <= counts[1], head0["decisions"]
    for after in read(tail):
        assert after["rank_workers"] == counts and after["workers_per_epoch"][-1] == counts[after["rank"]]


def test_memory_over_the_nodes_budget_switches_every_rank_down_together_exactly(tmp_path):
    log = tmp_path / "ddp.log"
    proc = run_logged([sys.executable, str(SCRIPT), str(tmp_path), "memory", "in_epoch"], log, env=env())
    assert proc.wait(timeout=150) == 0, log.read_text()[-3000:]
    a, b = read(tmp_path)
    assert a["memory_budget"] == b["memory_budget"] == 72 * 2**20  # the node's 144 MiB split between 2 ranks
    over = [i for i, why in enumerate(a["failed"]) if why and "memory budget" in why]
    assert over, a["decisions"]
    assert a["trials"][over[0]]["num_workers"] == 4  # the user's 4 workers went over, on the rank that held most
    # every rank recorded it at the same decision point and switched down together
    assert a["trials"] == b["trials"] and a["failed"] == b["failed"] and a["best_settings"] == b["best_settings"]
    assert a["best_settings"]["num_workers"] < 4
    for r in (a, b):
        for epoch, seen in enumerate(r["epochs"]):
            assert seen == expected_order(r["rank"], epoch, r["seed"]), f"rank {r['rank']} epoch {epoch}"
