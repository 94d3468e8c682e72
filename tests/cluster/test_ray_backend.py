"""`servelm cluster CONFIG --backend ray` as a user runs it, on a local Ray cluster it starts:
two replicas of a tiny model and the router as Ray actors; a replica whose serve process is
SIGKILLed, one whose actor is killed through Ray, and the router, all at once, come back and the
replicas into rotation; Ctrl-C leaves no process behind (Ray's own included) and no Ray session
directory. Then the same on a Ray cluster started by someone else, with a two-rank replica."""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

import httpx
import pytest

from servelm.ports import free_port_range
from servelm.testing.delivery_cluster import wait_until
from servelm.testing.process_tree import alive, descendants
from servelm.testing.tiny_model import write_tiny_checkpoint

pytestmark = pytest.mark.slow  # ~50 s: Ray's start, three servelm processes and two restarts on 2 cores


class ClusterCommand:
    """`servelm cluster` in its own session (a terminal's Ctrl-C reaches its whole group), its
    output collected by a thread so the pipe never fills."""

    def __init__(self, argv: list[str], env: dict[str, str] | None = None) -> None:
        command = [sys.executable, "-m", "servelm.cli", "cluster", *argv]
        self.process = subprocess.Popen(
            command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True, env=env
        )
        self.lines: list[str] = []
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.process.stdout is not None
        for line in self.process.stdout:
            self.lines.append(line)

    @property
    def output(self) -> str:
        return "".join(self.lines)

    def wait_for(self, pattern: str, timeout_s: float, count: int = 1) -> list[re.Match[str]]:
        """The first `count` matches of `pattern` in the output, once there are that many."""

        def found() -> bool:
            assert self.process.poll() is None or len(re.findall(pattern, self.output)) >= count, self.output
            return len(re.findall(pattern, self.output)) >= count

        try:
            wait_until(found, timeout_s, f"{count} x {pattern!r}", interval_s=0.2)
        except AssertionError as error:
            raise AssertionError(f"{error}\n{self.output}") from None
        return list(re.finditer(pattern, self.output))[:count]

    def pid_of(self, name: str, start: int) -> int:
        """The pid of `name`'s process as started the `start`-th time (1: the first)."""
        [*_, match] = self.wait_for(rf"started {name} \(pid (\d+)\)", 120, count=start)
        return int(match.group(1))


def _admin(router: str) -> dict[str, dict]:
    replicas = httpx.get(f"{router}/admin/replicas", timeout=10).json()["replicas"]
    return {replica["url"]: replica for replica in replicas}


def _serve_on_both(router: str, replicas: list[str]) -> None:
    """Requests through the router until each replica has answered one more than before."""
    before = {url: replica["num_requests"] for url, replica in _admin(router).items()}
    for i in range(4):  # round robin over two replicas: two each
        body = {"prompt": f"hello number {i}", "max_tokens": 3}
        response = httpx.post(f"{router}/v1/completions", json=body, timeout=60)
        assert response.status_code == 200 and response.json()["choices"][0]["text"], response.text
    after = _admin(router)
    assert all(after[url]["num_requests"] > before[url] for url in replicas), (before, after)


def _kill_actor(ray_address: str, namespace: str, name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """What an operator (or a failing node) does: kill the actor and let Ray restart it."""
    # Join the launcher's cluster as it was started: on loopback, with Ray's token authentication.
    monkeypatch.setenv("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    monkeypatch.setenv("RAY_AUTH_MODE", "token")
    import ray

    ray.init(address=ray_address, namespace=namespace, log_to_driver=False)
    try:
        ray.kill(ray.get_actor(name), no_restart=False)
    finally:
        ray.shutdown()


def test_ray_cluster_serves_restarts_dead_replicas_and_tears_down(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    model = write_tiny_checkpoint(tmp_path / "model", seed=1)
    base = free_port_range(7)  # router, 2 replicas, 2 x (KV events + snapshot)
    (tmp_path / "cluster.toml").write_text(
        f'model = "{model}"\n[replicas]\ncount = 2\nnum_threads = 1\nbase_port = {base + 1}\n'
        f'kv_events_base_port = {base + 3}\nargs = ["--num-blocks", "256"]\n'
        f'[router]\nport = {base}\npolicy = "round_robin"\n'
    )
    router, replicas = f"http://127.0.0.1:{base}", [f"http://127.0.0.1:{base + 1}", f"http://127.0.0.1:{base + 2}"]
    cluster = ClusterCommand([str(tmp_path / "cluster.toml"), "--backend", "ray", "--log-dir", str(tmp_path / "logs")])
    started: dict[int, str] = {}
    try:
        cluster.wait_for("Ctrl-C stops everything", 150)
        [ray_line] = cluster.wait_for(r"ray: cluster (\S+), namespace (\S+) ", 1)
        old = {name: cluster.pid_of(name, 1) for name in ("replica-0", "replica-1", "router")}
        _serve_on_both(router, replicas)

        os.kill(old["replica-0"], signal.SIGKILL)  # the serve process dies under its actor
        _kill_actor(ray_line.group(1), ray_line.group(2), "replica-1", monkeypatch)  # the actor dies
        os.kill(old["router"], signal.SIGKILL)  # and the router, all at once
        for name in ("replica-0", "replica-1"):  # registered once at the start, again once back
            cluster.wait_for(rf"{name} registered with the router", 150, count=2)
        assert all(cluster.pid_of(name, 2) != old[name] for name in old)
        cluster.wait_for(r"router serving at", 60, count=2)
        # replica-1's serve process was not killed by anyone but went with its actor.
        wait_until(lambda: not any(alive(pid) for pid in old.values()), 30, "the old processes to be gone")
        assert all(_admin(router)[url]["healthy"] for url in replicas)
        _serve_on_both(router, replicas)

        started = descendants(cluster.process.pid)
        kinds = " ".join(started.values())
        assert "gcs_server" in kinds and "raylet" in kinds and kinds.count("servelm.cli serve") == 2, started
        [session_dir] = _session_dirs(started)

        os.killpg(cluster.process.pid, signal.SIGINT)  # Ctrl-C in its terminal
        assert cluster.process.wait(timeout=90) == 0, cluster.output
        wait_until(lambda: not any(alive(pid) for pid in started), 30, "every process it started to exit")
        assert not Path(session_dir).exists()
    finally:  # a failed test leaves nothing running either
        leftover = started or descendants(cluster.process.pid)
        if cluster.process.poll() is None:
            os.killpg(cluster.process.pid, signal.SIGKILL)
            cluster.process.wait()
        for pid in leftover:
            if alive(pid):
                os.kill(pid, signal.SIGKILL)
        for directory in _session_dirs(leftover):  # the launcher's, when it could not delete it
            shutil.rmtree(directory, ignore_errors=True)


def _session_dirs(processes: dict[int, str]) -> set[str]:
    """The Ray session root a local cluster's processes were started with."""
    return set(re.findall(r"--session-dir=(/tmp/servelm-ray-[^/\s]+)/", " ".join(processes.values())))


def test_ray_cluster_joins_an_existing_cluster_and_keeps_a_multi_rank_replica_together(tmp_path: Path) -> None:
    """`--address`: a Ray cluster someone else started (here `ray start --head`, with two logical
    GPUs: Ray's GPU accounting is logical too). A 2-rank replica with a GPU per rank gets a
    placement group of two bundles, and its serve process sees both bundles' GPUs, not just the
    one Ray gave its actor. Stopping removes what servelm placed and leaves the cluster up."""
    model = write_tiny_checkpoint(tmp_path / "model", seed=1)
    base = free_port_range(5)  # router, the replica, its KV events + snapshot, Ray's GCS
    (tmp_path / "cluster.toml").write_text(
        f'model = "{model}"\n[replicas]\ncount = 1\nnum_threads = 1\nbase_port = {base + 1}\nkv_events_base_port = {base + 2}\n'
        f'tensor_parallel_size = 2\nnum_gpus = 1\nargs = ["--num-blocks", "128"]\n'
        f'[router]\nport = {base}\npolicy = "round_robin"\n'
    )
    temp_dir = tempfile.mkdtemp(prefix="servelm-raytest-", dir="/tmp")  # short: Ray's sockets live there
    # On loopback, as the launcher's own; `ray start` turns on token authentication, and a driver
    # that joins must say it uses it (the token: ~/.ray/auth_token, as for the launcher's own).
    env = {**os.environ, "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "RAY_AUTH_MODE": "token"}
    head = subprocess.Popen(
        [str(Path(sys.executable).parent / "ray"), "start", "--head", "--block", f"--port={base + 4}",
         "--num-cpus=4", "--num-gpus=2", "--include-dashboard=false", f"--temp-dir={temp_dir}",
         f"--object-store-memory={80 * 2**20}", "--disable-usage-stats"],
        env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
    )  # fmt: skip
    cluster: ClusterCommand | None = None
    try:
        argv = [str(tmp_path / "cluster.toml"), "--backend", "ray", "--address", f"127.0.0.1:{base + 4}"]
        cluster = ClusterCommand([*argv, "--log-dir", str(tmp_path / "logs")], env)
        cluster.wait_for("Ctrl-C stops everything", 150)
        serve = cluster.pid_of("replica-0", 1)
        environ = Path(f"/proc/{serve}/environ").read_bytes().split(b"\0")
        [visible] = [v.split(b"=", 1)[1].decode() for v in environ if v.startswith(b"CUDA_VISIBLE_DEVICES=")]
        assert sorted(visible.split(",")) == ["0", "1"]  # bundle 0's GPU (the actor's) and bundle 1's
        assert any("servelm.worker.rank_main" in c for c in descendants(serve).values())  # rank 1, beside it
        body = {"prompt": "hello there", "max_tokens": 3}
        response = httpx.post(f"http://127.0.0.1:{base}/v1/completions", json=body, timeout=60)
        assert response.status_code == 200 and response.json()["choices"][0]["text"], response.text

        ours = descendants(head.pid)
        assert sum("ray::ProcessHost" in c for c in ours.values()) == 2, ours
        os.killpg(cluster.process.pid, signal.SIGINT)
        assert cluster.process.wait(timeout=90) == 0, cluster.output
        wait_until(lambda: not any("ray::ProcessHost" in c for c in descendants(head.pid).values()), 30, "actors gone")
        assert not any(alive(pid) for pid, c in ours.items() if "servelm.cli" in c)
        assert head.poll() is None  # the cluster itself is not ours to stop
    finally:
        leftover = descendants(head.pid)
        if cluster is not None and cluster.process.poll() is None:
            os.killpg(cluster.process.pid, signal.SIGKILL)
            cluster.process.wait()
        head.terminate()  # `ray start --block` stops the processes it started
        try:
            head.wait(timeout=30)
        except subprocess.TimeoutExpired:
            head.kill()
            head.wait()
        for pid in leftover:
            if alive(pid):
                os.kill(pid, signal.SIGKILL)
        shutil.rmtree(temp_dir, ignore_errors=True)
