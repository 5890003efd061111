"""The KV pool inside a container: free memory is the cgroup's limit less its usage (v2 and v1, read from a faked
cgroup file tree), not the host's MemAvailable that /proc/meminfo reports, and `engine run` sizes its pool to
what its prompts can use rather than to a fraction of the machine."""
from __future__ import annotations

from pathlib import Path

import pytest

from engine.runtime import kv_budget
from engine.runtime.cgroup_memory import cgroup_room
from tests.reliability.conftest import run_cli
from tests.runtime.test_kv_budget import config

MiB = 1 << 20
GiB = 1 << 30


def write(root: Path, files: dict[str, str]) -> None:
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)


def v2_tree(tmp_path: Path) -> tuple[Path, Path]:
    """A pod limited to 2 GiB using 1.5 GiB, 0.5 GiB of it reclaimable file cache; the container itself unlimited."""
    root = tmp_path / "cgroup"
    write(root, {"cgroup.controllers": "cpu memory\n",
                 "kubepods/memory.max": "max\n",
                 "kubepods/pod1/memory.max": f"{2 * GiB}\n", "kubepods/pod1/memory.current": f"{3 * GiB // 2}\n",
                 "kubepods/pod1/memory.stat": f"anon 1\ninactive_file {GiB // 2}\nactive_file 7\n",
                 "kubepods/pod1/c1/memory.max": "max\n", "kubepods/pod1/c1/memory.current": "100\n"})
    (tmp_path / "self_cgroup").write_text("0::/kubepods/pod1/c1\n")
    return tmp_path / "self_cgroup", root


def test_cgroup_v2_limit_of_an_ancestor(tmp_path):
    assert cgroup_room(*v2_tree(tmp_path)) == 2 * GiB - (3 * GiB // 2 - GiB // 2)


def test_cgroup_v1_limit(tmp_path):
    root = tmp_path / "cgroup"
    write(root, {"memory/memory.limit_in_bytes": "9223372036854771712\n",                   # the host: no limit
                 "memory/docker/abc/memory.limit_in_bytes": f"{512 * MiB}\n",
                 "memory/docker/abc/memory.usage_in_bytes": f"{100 * MiB}\n",
                 "memory/docker/abc/memory.stat": f"cache 5\ntotal_inactive_file {20 * MiB}\n"})
    proc = tmp_path / "self_cgroup"
    proc.write_text("9:systemd:/\n4:memory:/docker/abc\n0::/\n")
    assert cgroup_room(proc, root) == 512 * MiB - 80 * MiB
    proc.write_text("4:memory:/host/path/not/visible\n")       # inside the container: its mount root is its cgroup
    write(root, {"memory/memory.limit_in_bytes": f"{GiB}\n", "memory/memory.usage_in_bytes": f"{GiB + 5}\n"})
    assert cgroup_room(proc, root) == 0


def test_no_limit_is_none(tmp_path):
    root = tmp_path / "cgroup"
    write(root, {"cgroup.controllers": "memory\n", "memory.max": "max\n", "memory.current": "5\n"})
    proc = tmp_path / "self_cgroup"
    proc.write_text("0::/\n")
    assert cgroup_room(proc, root) is None
    assert cgroup_room(tmp_path / "absent", root) is None


def test_the_kv_pool_fits_the_container_not_the_host(tmp_path, monkeypatch):
    """Host 100 GiB free, container 1 GiB of room: half of (1 GiB - weights - activations) goes to the pool."""
    proc, root = v2_tree(tmp_path)
    monkeypatch.setattr(kv_budget, "cgroup_room", lambda: cgroup_room(proc, root))
    monkeypatch.setattr(kv_budget, "_host_available", lambda: 100 * GiB)
    assert kv_budget.available_memory() == GiB
    plan = kv_budget.plan_kv_cache(config(max_batch_size=1000), kv_cache_mem_fraction=0.5)
    assert plan.num_blocks == (GiB - 120 * MiB) // 2 // MiB                  # 1 MiB blocks; 100 + 20 MiB reserved


@pytest.mark.parametrize("prompts", [1, 3])
def test_engine_run_pool_holds_its_prompts_not_the_batch(artifacts, prompts):
    """The tiny engine: max_batch_size 8, max_seq_len 256, 8-token blocks. Its pool was 8 x 32 blocks for any run."""
    texts = [a for i in range(prompts) for a in ("--input-text", f"hello {i}")]
    code, err = run_cli("run", "--engine-dir", str(artifacts.engine), *texts, "--max-output-len", "4")
    assert code == 0, err
    assert f"KV cache {prompts * 256} tokens ({prompts * 32} blocks of 8" in err, err
