"""The `ray` launcher: the cluster config's processes as Ray actors, on a Ray cluster.

    driver (`servelm cluster --backend ray`)        a Ray node
      per process: a placement group, one          ┌─────────────────────────────────────────┐
      bundle {CPU, GPU} per rank, STRICT_PACK      │ bundle 0: ProcessHost actor (ray_actor)  │
      (a multi-rank replica's ranks talk over      │   └─ servelm serve | router (rank 0)     │
      loopback: one node)                          │        └─ ranks 1..N-1 (their own procs) │
      ProcessHost actor in bundle 0 ──────────────▶│ bundles 1..N-1: reserved for those ranks │
      check(): status, /ready, /admin/replicas     └─────────────────────────────────────────┘

The driver supervises; the actors only carry out (start, status, HTTP from their node, stop).
Each process moves through:

               start(spec)                 /ready answers 200
      WAITING ────────────▶ STARTING ─────────────────────────▶ SERVING
         ▲                     │  exited, actor died, or not       │  exited, or actor died
         └─────────────────────┴──── ready in startup_timeout_s ◀──┘  (Ray restarts a dead actor
           (then starts it again after a backoff: at once, 1, 2, 4 ... 30 s)  in its bundle: max_restarts)

A replica that reaches SERVING (at the start, or back after a restart) is registered with the
router through its admin API (POST /admin/replicas, after DELETE of its old URL if it came back
elsewhere), which puts it in rotation at once instead of at the router's next health check; so
is every serving replica when the router reaches SERVING (a restarted router also has every
replica on its command line). Placement stays here: the router only ever sees URLs.

`start()` is strict instead: a process that fails to start stops everything and raises (a bad
config should fail, not loop). `stop()`: router first, then the replicas (SIGTERM, then SIGKILL
after `stop_timeout_s`), the actors and placement groups removed, and a local Ray cluster this
launcher started shut down and its session directory deleted. Safe to call twice.

Ray is imported only here (and inside the actor's methods): the rest of servelm runs without it.
"""

from __future__ import annotations

import logging
import math
import os
import shutil
import tempfile
import time
import uuid
from dataclasses import dataclass
from enum import Enum
from pathlib import Path
from types import ModuleType
from typing import Any

from servelm.cluster.ray_actor import ProcessHost, ProcessStatus, bundle_gpu_ids
from servelm.cluster.spec import ClusterConfig, ProcessSpec

logger = logging.getLogger(__name__)

# Seconds before the next start after k failed starts or deaths in a row: the first restart at once.
_BACKOFF_S = (0.0, 0.0, 1.0, 2.0, 4.0, 8.0, 16.0, 30.0)
_CALL_TIMEOUT_S = 30.0  # an actor call that must answer (the actor just answered status())
_POLL_TIMEOUT_S = 1.0  # how long check() waits for status answers (a restarting actor answers late)
# A local cluster carries only small control messages between the driver and the actors: Ray's
# own default (30% of memory) would reserve gigabytes of shared memory for nothing.
_LOCAL_OBJECT_STORE_BYTES = 80 * 2**20
_LOCAL_PLACEMENT_TIMEOUT_S = 15.0
_RAY_CLUSTER_ENV = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"  # "0": one node, on 127.0.0.1  # nothing joins a local cluster: resources missing now stay missing


def import_ray() -> ModuleType:
    try:
        import ray
    except ImportError as error:
        raise ImportError("--backend ray needs Ray: pip install 'servelm[ray]'") from error
    return ray


def _backoff_s(failures: int) -> float:
    return _BACKOFF_S[min(failures, len(_BACKOFF_S) - 1)]


class State(str, Enum):
    WAITING = "waiting"  # nothing running: to be started (again) once its backoff has passed
    STARTING = "starting"  # started, not ready yet
    SERVING = "serving"


@dataclass(eq=False)  # identity: units key dicts
class Unit:
    """One supervised process: its placement group, its actor, and where it stands."""

    template: ProcessSpec  # name, role and resources; the spec is recomputed at every start
    placement_group: Any
    actor: Any  # a ray ActorHandle of ProcessHost
    spec: ProcessSpec | None = None  # as last started
    address: str | None = None  # its node's address, asked at every start (a restart may move it)
    state: State = State.WAITING
    since: float = 0.0  # when `state` began
    failures: int = 0  # failed starts or deaths since it last served
    restarts: int = 0
    registered_url: str | None = None  # replicas: the URL the router has for it
    status_ref: Any = None  # an unanswered status() call, waited on again next time

    @property
    def name(self) -> str:
        return self.template.name


class RayCluster:
    def __init__(
        self, config: ClusterConfig, log_dir: Path, startup_timeout_s: float = 300.0, address: str | None = None,
        stop_timeout_s: float = 30.0,
    ) -> None:  # fmt: skip
        if address is None:
            # A local cluster is this machine's alone: Ray on loopback, reachable from nowhere else
            # (Ray's single-machine mode; read when ray is first imported, and by its workers).
            os.environ[_RAY_CLUSTER_ENV] = "0"
        self.ray = import_ray()
        self.config = config
        self.log_dir = log_dir
        self.startup_timeout_s = startup_timeout_s
        self.stop_timeout_s = stop_timeout_s
        self.address = address  # None: start a local Ray cluster
        self.namespace = f"servelm-{uuid.uuid4().hex[:8]}"  # actor names are unique per namespace
        self.units: list[Unit] = []
        self._temp_dir: str | None = None

    # -- the Launcher interface ---------------------------------------------------------------

    def start(self) -> None:
        """Place and start everything; return once all serve. On any failure stop all and raise."""
        try:
            self._connect()
            replicas = [self._place(spec) for spec in self.config.replica_processes()]
            self._place(self.config.router_process([r.template for r in replicas]))
            self._await_placement(self.units)
            # The router right after the replicas, not once they serve: it needs only their
            # addresses (known once placed) and takes each into rotation when it is ready.
            for unit in self.units:
                self._launch(unit)
            self._await_serving(self.units)
        except BaseException:
            self.stop()
            raise

    def urls(self) -> dict[str, str]:
        return {unit.name: (unit.spec or unit.template).url for unit in self.units}

    def check(self) -> str | None:
        """One supervision pass: restart what died, re-register what came back. Never asks the
        cluster to stop (None): a process that keeps failing is retried with a growing backoff."""
        for unit, status in self._poll().items():
            try:
                self._step(unit, status, strict=False)
            except (self.ray.exceptions.RayError, TimeoutError) as error:
                # Its actor died (or hung) between two calls: the next pass finds it down or restarted.
                logger.warning("%s: %s: %s", unit.name, type(error).__name__, error)
        return None

    def stop(self) -> None:
        ray = self.ray
        if ray.is_initialized():
            for group in (self._role("router"), self._role("replica")):  # router first: no new requests
                self._stop_processes(group)
            for unit in self.units:
                ray.kill(unit.actor, no_restart=True)
                ray.util.remove_placement_group(unit.placement_group)
            ray.shutdown()  # a local cluster: stops its processes; an existing one: disconnects
        self.units = []
        if self._temp_dir is not None:
            shutil.rmtree(self._temp_dir, ignore_errors=True)
            self._temp_dir = None

    # -- placement ----------------------------------------------------------------------------

    def _connect(self) -> None:
        ray = self.ray
        if self.address is not None:
            ray.init(address=self.address, namespace=self.namespace)
        else:
            specs = self.config.replica_processes()
            specs.append(self.config.router_process(specs))
            num_cpus = math.ceil(sum(spec.num_ranks * spec.cpus_per_rank for spec in specs))
            # A short path: Ray's unix sockets live under it (108 bytes at most).
            self._temp_dir = tempfile.mkdtemp(prefix="servelm-ray-", dir="/tmp")
            ray.init(
                num_cpus=num_cpus,  # logical: what the config asks for, whatever the machine's cores
                object_store_memory=_LOCAL_OBJECT_STORE_BYTES, include_dashboard=False,
                _temp_dir=self._temp_dir, namespace=self.namespace,
            )  # fmt: skip
        gcs = ray.get_runtime_context().gcs_address
        logger.info("ray: cluster %s, namespace %s (actors named after their process)", gcs, self.namespace)

    def _place(self, template: ProcessSpec) -> Unit:
        ray = self.ray
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        bundle = {"CPU": template.cpus_per_rank, "GPU": template.gpus_per_rank}
        bundle = {resource: amount for resource, amount in bundle.items() if amount > 0}
        placement_group = ray.util.placement_group(
            [bundle] * template.num_ranks, strategy="STRICT_PACK", name=f"{self.namespace}-{template.name}"
        )
        host = ray.remote(ProcessHost).options(
            name=template.name, namespace=self.namespace,
            max_restarts=-1,  # Ray brings a dead actor back in its bundle; the driver then restarts the process
            max_task_retries=0,  # a call to a dead actor fails: the driver asks again
            num_cpus=template.cpus_per_rank, num_gpus=template.gpus_per_rank,
            scheduling_strategy=PlacementGroupSchedulingStrategy(placement_group, placement_group_bundle_index=0),
        )  # fmt: skip
        actor = host.remote(str(self.log_dir))
        unit = Unit(template, placement_group, actor)
        self.units.append(unit)
        return unit

    def _await_placement(self, units: list[Unit]) -> None:
        ray = self.ray
        timeout_s = self.startup_timeout_s if self.address is not None else _LOCAL_PLACEMENT_TIMEOUT_S
        for unit in units:
            ready, _ = ray.wait([unit.placement_group.ready()], timeout=timeout_s)
            if not ready:
                t = unit.template
                raise RuntimeError(
                    f"cannot place {unit.name} within {timeout_s:.0f} s: it needs {t.num_ranks} bundle(s) of "
                    f"{t.cpus_per_rank} CPU and {t.gpus_per_rank} GPU on one node; "
                    f"the cluster has {ray.available_resources()} available"
                )

    # -- supervision ----------------------------------------------------------------------------

    def _await_serving(self, units: list[Unit]) -> None:
        """Wait until every one of these started units serves (strict: a failure raises)."""
        deadline = time.monotonic() + self.startup_timeout_s
        while any(unit.state is not State.SERVING for unit in units):
            statuses = self._poll(units)
            for unit in units:
                self._step(unit, statuses[unit], strict=True)
            if time.monotonic() > deadline:
                names = ", ".join(unit.name for unit in units if unit.state is not State.SERVING)
                raise RuntimeError(f"not ready after {self.startup_timeout_s:.0f} s: {names}")
            time.sleep(0.25)

    def _poll(self, units: list[Unit] | None = None) -> dict[Unit, ProcessStatus | None]:
        """Every unit's status, None where its actor has not answered (dead, or Ray restarting it)."""
        ray = self.ray
        units = self.units if units is None else units
        for unit in units:
            if unit.status_ref is None:
                unit.status_ref = unit.actor.status.remote()
        refs = [unit.status_ref for unit in units]
        ready, _ = ray.wait(refs, num_returns=len(refs), timeout=_POLL_TIMEOUT_S)
        answered = set(ready)
        statuses: dict[Unit, ProcessStatus | None] = {}
        for unit in units:
            statuses[unit] = None
            if unit.status_ref in answered:
                ref, unit.status_ref = unit.status_ref, None
                try:
                    statuses[unit] = ray.get(ref)
                except ray.exceptions.RayActorError:
                    pass  # died while asked: the next call waits for its restart
        return statuses

    def _step(self, unit: Unit, status: ProcessStatus | None, strict: bool) -> None:
        now = time.monotonic()
        if status is None or status.pid is None or status.returncode is not None:
            if unit.state is not State.WAITING:
                if status is None:
                    reason = "its actor is down (Ray restarts it)"
                elif status.pid is None:
                    reason = "its actor was restarted (the process died with the old one)"
                else:
                    reason = f"its process exited with {status.returncode}"
                self._down(unit, reason, strict)
            if status is not None and now >= unit.since + _backoff_s(unit.failures):
                self._launch(unit)
            return
        if unit.state is State.STARTING:
            if self._call(unit.actor.request.remote("GET", "/ready")) == 200:
                self._serving(unit)
            elif now - unit.since > self.startup_timeout_s:
                self._call(unit.actor.stop.remote(self.stop_timeout_s), self.stop_timeout_s + _CALL_TIMEOUT_S)
                self._down(unit, f"not ready after {self.startup_timeout_s:.0f} s", strict)

    def _launch(self, unit: Unit) -> None:
        """Start the unit's process on its actor, at the address its actor is at now."""
        unit.address = self._call(unit.actor.node_address.remote())
        addresses = {u.name: u.address for u in self.units if u.address is not None}
        if unit.template.role == "router":
            replicas = [u.spec or u.template for u in self._role("replica")]
            spec = self.config.router_process(replicas, unit.address)
            for replica, replica_spec in zip(self._role("replica"), replicas):  # on its command line
                replica.registered_url = replica_spec.url
        else:
            spec = next(s for s in self.config.replica_processes(addresses) if s.name == unit.name)
        pid = self._call(unit.actor.start.remote(spec, self._gpu_env(unit)))
        if unit.spec is not None:
            unit.restarts += 1
        unit.spec, unit.state, unit.since = spec, State.STARTING, time.monotonic()
        logger.info(
            "started %s (pid %d) on %s: log %s", unit.name, pid, unit.address, self.log_dir / f"{unit.name}.log"
        )

    def _down(self, unit: Unit, reason: str, strict: bool) -> None:
        tail = ""
        try:
            tail = self._call(unit.actor.log_tail.remote(1500), timeout_s=5.0)
        except (self.ray.exceptions.RayError, TimeoutError):
            pass  # the actor is gone: so is what it could tell
        if strict:
            raise RuntimeError(f"{unit.name}: {reason}\n{tail}")
        unit.failures += 1
        unit.state, unit.since = State.WAITING, time.monotonic()
        logger.warning(
            "%s is down: %s; starting it again in %.0f s. Its log ends:\n%s",
            unit.name, reason, _backoff_s(unit.failures), tail,
        )  # fmt: skip

    def _serving(self, unit: Unit) -> None:
        assert unit.spec is not None  # set by _launch, which STARTING follows
        unit.state, unit.failures = State.SERVING, 0
        logger.info("%s serving at %s (restarts: %d)", unit.name, unit.spec.url, unit.restarts)
        # Into the router's rotation now, not at its next health check (a replica and the router
        # start together: the router may have found the replica not ready yet).
        for replica in self._role("replica") if unit.template.role == "router" else [unit]:
            if replica.state is State.SERVING:
                self._register(replica)

    def _register(self, unit: Unit) -> None:
        """Tell the router (when it serves) that this replica serves, at the URL it has now. Adding
        a URL the router has is safe: it keeps its counters and checks the replica at once."""
        assert unit.spec is not None
        routers = [u for u in self._role("router") if u.state is State.SERVING]
        if not routers:
            return  # the router, once started, gets every replica on its command line
        admin = routers[0].actor.request
        key = self.config.api_key
        if unit.registered_url is not None and unit.registered_url != unit.spec.url:
            self._call(admin.remote("DELETE", "/admin/replicas", {"url": unit.registered_url}, key))
        body = {"url": unit.spec.url, "kv_events": unit.spec.kv_events, "role": unit.spec.kv_role}
        code = self._call(admin.remote("POST", "/admin/replicas", body, key))
        if code == 201:
            unit.registered_url = unit.spec.url
            logger.info("%s registered with the router at %s", unit.name, unit.spec.url)
        else:  # the router's own health checks still find it at a URL it already had
            logger.warning("registering %s with the router failed: HTTP %s", unit.name, code)

    def _gpu_env(self, unit: Unit) -> dict[str, str]:
        """A multi-rank process's GPUs: every bundle's, asked anew at every start (Ray hands the
        actor only its own bundle's; the other ranks are the process's children)."""
        t = unit.template
        if t.num_ranks == 1 or t.gpus_per_rank == 0:
            return {}  # Ray set CUDA_VISIBLE_DEVICES for the actor, and the process inherits it
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        ids: list[str] = self._call(unit.actor.gpu_ids.remote())
        probe = self.ray.remote(bundle_gpu_ids)
        for index in range(1, t.num_ranks):
            strategy = PlacementGroupSchedulingStrategy(unit.placement_group, placement_group_bundle_index=index)
            ids += self._call(
                probe.options(num_cpus=0, num_gpus=t.gpus_per_rank, scheduling_strategy=strategy).remote()
            )
        return {"CUDA_VISIBLE_DEVICES": ",".join(dict.fromkeys(ids))}  # fractional GPUs: bundles may share one

    def _stop_processes(self, units: list[Unit]) -> None:
        refs = [unit.actor.stop.remote(self.stop_timeout_s) for unit in units]
        deadline = time.monotonic() + self.stop_timeout_s + _CALL_TIMEOUT_S
        for unit, ref in zip(units, refs):
            try:
                self.ray.get(ref, timeout=max(0.1, deadline - time.monotonic()))
            except (self.ray.exceptions.RayError, TimeoutError) as error:
                # Its actor is dead or stuck: ray.kill next takes its process with it (death signal).
                logger.warning("stopping %s: %s: %s", unit.name, type(error).__name__, error)

    def _call(self, ref: Any, timeout_s: float = _CALL_TIMEOUT_S) -> Any:
        return self.ray.get(ref, timeout=timeout_s)

    def _role(self, role: str) -> list[Unit]:
        return [unit for unit in self.units if unit.template.role == role]
