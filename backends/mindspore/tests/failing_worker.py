"""A worker of test_launch.py: rank 1 raises while rank 0 waits in an all-reduce it never
completes; rank 0's pid goes to ``waiting.pid`` so the test can see it was killed."""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import numpy as np
from mindspore import Tensor, ops

sys.path.insert(0, str(Path(__file__).parent))
from launch import worker_main


def body(rank: int, out: Path) -> None:
    waiting = out / "waiting.pid"
    if rank == 1:
        for _ in range(600):  # fail once rank 0 is (about to be) blocked in the collective
            if waiting.exists():
                break
            time.sleep(0.1)
        raise RuntimeError("rank 1 fails on purpose")
    waiting.write_text(str(os.getpid()))
    ops.AllReduce()(Tensor(np.ones(4, np.float32))).asnumpy()  # rank 1 never joins


if __name__ == "__main__":
    worker_main(body)
