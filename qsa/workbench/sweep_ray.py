"""Ray backend of `qsa sweep`: every point is a Ray task on a cluster, run by the same point
runner as on one host, so markers, manifests, digests and resume rules are the same.

Why Ray, and what it takes: a team that outgrows one host already runs a cluster; Ray places
each point on a free GPU (one GPU per task; one CPU per task for functional CPU sweeps) and
sets its CUDA_VISIBLE_DEVICES / ROCR_VISIBLE_DEVICES, so the workbench needs no scheduler of
its own. The driver holds the sweep lock and writes the table and the report; the tasks write
each point's folder, so the sweep folder (`--out`) must be on a filesystem every node mounts
at the same path, and every node needs this package (and the notebook's dependencies)
installed. A killed driver or a lost node leaves no marker for its unfinished points: the
next run of the same command runs exactly those.
"""

from __future__ import annotations

import dataclasses
import platform
from collections.abc import Callable, Sequence
from typing import Any

from qsa.workbench.sweep_point import (Executor, Slot, SweepError, SweepPoint, SweepSpec,
                                       cpu_env, device_slug_for, run_point)

TASK_CPUS = 1


def _ray() -> Any:
    try:
        import ray
    except ImportError:
        raise SweepError("backend ray: the ray package is not installed (pip install "
                         "'qsa-workbench[cluster]')") from None
    return ray


def _task_slot(gpu: bool) -> Slot:
    """The worker's device as the point runner records it: host and the GPUs Ray gave it.
    Ray already narrowed the visible devices, so the slot changes no variable; a CPU task
    forces the interpreter, as the local CPU slots do."""
    ray = _ray()
    if gpu:
        ids = ",".join(str(i) for i in ray.get_gpu_ids())
        return Slot(f"ray:{platform.node()}:gpu{ids}", {})
    return Slot(f"ray:{platform.node()}:cpu", cpu_env(TASK_CPUS))


def _probe_slug(gpu: bool) -> str:
    return device_slug_for([_task_slot(gpu)])


def _run_task(point: SweepPoint, spec: SweepSpec, version: str, gpu: bool) -> dict[str, Any]:
    return run_point(point, spec, version, _task_slot(gpu))


@dataclasses.dataclass
class RayCluster:
    """A connected cluster and whether the sweep's points ask it for GPUs."""

    address: str
    gpu: bool

    @property
    def label(self) -> str:
        return f"ray:{self.address}:{'gpu' if self.gpu else 'cpu'}"

    def _options(self) -> dict[str, Any]:
        return {"num_gpus": 1, "num_cpus": TASK_CPUS} if self.gpu else {"num_cpus": TASK_CPUS}

    def map(self, fn: Callable[..., Any], calls: Sequence[tuple]) -> list[Any]:
        """`fn(*args)` for every args tuple, each a task in its own worker process on one GPU
        (or, functional, one CPU under the Triton interpreter); results in order, a task's
        exception in place of its result."""
        ray = _ray()
        env = {} if self.gpu else cpu_env(TASK_CPUS)
        task = ray.remote(fn).options(max_retries=0, runtime_env={"env_vars": env},
                                      **self._options())
        refs = [task.remote(*args) for args in calls]
        out: list[Any] = []
        for ref in refs:
            try:
                out.append(ray.get(ref))
            except Exception as e:  # noqa: BLE001 - handed back for the caller to record
                out.append(getattr(e, "cause", None) or e)
        return out

    def device_slug(self) -> str:
        """The store folder of the device the tasks run on, asked on a worker (the driver
        may have no GPU)."""
        ray = _ray()
        return ray.get(ray.remote(_probe_slug).options(**self._options()).remote(self.gpu))

    def executor(self, spec: SweepSpec, version: str) -> Executor:
        ray = _ray()
        task = ray.remote(_run_task).options(max_retries=0, **self._options())

        def execute(todo: Sequence[SweepPoint],
                    on_done: Callable[[SweepPoint, dict[str, Any]], None]) -> None:
            pending = {task.remote(p, spec, version, self.gpu): p for p in todo}
            try:
                while pending:
                    done, _ = ray.wait(list(pending), num_returns=1)
                    for ref in done:
                        point = pending.pop(ref)
                        try:
                            marker = ray.get(ref)
                        except Exception as e:  # a lost node or a killed worker: no marker
                            marker = {"status": "failed", "error": {
                                "ename": type(e).__name__,
                                "evalue": f"the Ray task of this point died ({e}); it has "
                                          "no marker and runs again on resume"}}
                        on_done(point, marker)
            except BaseException:
                for ref in pending:  # Ctrl-C: stop the tasks, keep every finished point
                    ray.cancel(ref, force=True)
                raise

        return execute


def connect(address: str, devices: Any) -> RayCluster:
    """Join the cluster at `address` ("auto": the one this node belongs to; "ray://...": a
    remote one; "local": start one on this machine). Points ask for GPUs when the spec allows
    GPUs and the cluster has some, else for CPUs (functional runs)."""
    ray = _ray()
    if not ray.is_initialized():
        try:
            ray.init(address=None if address == "local" else address,
                     include_dashboard=False, log_to_driver=False)
        except ConnectionError as e:
            raise SweepError(f"backend ray: no cluster at {address!r} ({e})") from None
    gpus = ray.cluster_resources().get("GPU", 0)
    return RayCluster(address, devices != "cpu" and gpus >= 1)
