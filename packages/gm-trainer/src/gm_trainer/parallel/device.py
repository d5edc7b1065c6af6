"""Device detection and process-group start-up: npu -> cuda -> cpu."""

from __future__ import annotations

import datetime
import importlib.util
import os

import torch
import torch.distributed as dist

_BACKENDS = {"npu": "hccl", "cuda": "nccl", "cpu": "gloo"}


def detect_device_type() -> str:
    """``"npu"`` when an Ascend NPU is usable, else ``"cuda"``, else ``"cpu"``.

    The same answer is used for the trainer device and the device mesh.
    """
    npu = getattr(torch, "npu", None)
    if npu is not None and npu.is_available():
        return "npu"
    if torch.cuda.is_available():
        return "cuda"
    return "cpu"


def default_device() -> torch.device:
    """This rank's device: ``LOCAL_RANK`` picks among several accelerators."""
    kind = detect_device_type()
    if kind == "cpu":
        return torch.device("cpu")
    return torch.device(kind, int(os.environ.get("LOCAL_RANK", "0")))


def torch_npu_without_npu() -> bool:
    """torch_npu is installed but no NPU is present.

    Optimizer kernel selection then probes the NPU and fails to initialise it, so the
    optimizer must be built with ``foreach=False``.
    """
    if importlib.util.find_spec("torch_npu") is None:
        return False
    return detect_device_type() != "npu"


def init_distributed(timeout_s: float = 300.0) -> tuple[int, int]:
    """Start the default process group from the launcher's environment.

    Returns ``(rank, world_size)``; ``(0, 1)`` when not launched by torchrun / the elastic
    launcher (no ``RANK`` / ``WORLD_SIZE`` in the environment) or when already initialised
    by the caller, whose group is then used as it is.
    """
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        return 0, 1
    kind = detect_device_type()
    if kind != "cpu":
        getattr(torch, kind).set_device(default_device())
    timeout = datetime.timedelta(seconds=timeout_s)
    dist.init_process_group(backend=_BACKENDS[kind], timeout=timeout, **_restart_store(timeout))
    return dist.get_rank(), dist.get_world_size()


def _restart_store(timeout: datetime.timedelta) -> dict[str, object]:
    """Under a torchrun restart: the agent's store with a prefix of its own for this attempt.

    torchrun shares one TCPStore across restarts, and the workers' ``env://`` keys carry no
    attempt prefix, so a restarted rank could read the gloo address of a dead rank of the
    previous attempt and wait in ``connectFullMesh`` until the timeout (seen with torch 2.13).
    """
    restart = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    if restart == "0" or os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return {}
    store = dist.TCPStore(
        os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False, timeout=timeout
    )
    return {
        "store": dist.PrefixStore(f"gm-trainer/attempt-{restart}", store),
        "rank": int(os.environ["RANK"]),
        "world_size": int(os.environ["WORLD_SIZE"]),
    }
