"""One worker of test_parity.py: the example's network through ``ShardedTrainer`` in three
settings (the example's plan; no plan with and without buckets), ``STEPS`` Adam steps on
this rank's rows of the saved global batches; results to ``rank<r>_<case>.npz/.json``."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
from mindspore import Tensor, nn

sys.path.insert(0, str(Path(__file__).parent))
from common import PLAN_YAML, adam, load_example, network
from launch import worker_main

from gm_config import ConfigError, PassConfig, create_sharding_plan_from_yaml
from gm_mindspore import ShardedTrainer

CASES = {
    "plan": (PassConfig(), create_sharding_plan_from_yaml(PLAN_YAML)),
    "unbucketed": (PassConfig(bucket_cap_mb=None), None),
    "bucketed": (PassConfig(), None),
}


def body(rank: int, out: Path) -> None:
    data = dict(np.load(out / "inputs.npz"))
    example = load_example()
    try:  # FSDP off on 2 workers: nothing would keep them in sync
        ShardedTrainer(example.PlanNet(), nn.MSELoss(), adam, PassConfig(fsdp_enabled=False))
    except ConfigError as e:
        (out / f"rank{rank}_fsdp_off.txt").write_text(str(e))
    world = 2
    local = data["x"].shape[1] // world
    rows = slice(rank * local, (rank + 1) * local)
    for case, (config, plan) in CASES.items():
        trainer = ShardedTrainer(network(example, data), nn.MSELoss(), adam, config, plan)
        losses = [
            trainer.train_step(Tensor(x[rows]), Tensor(y[rows]))
            for x, y in zip(data["x"], data["y"])
        ]
        counts = trainer.collective_counts
        layout = trainer.layout
        info = {
            "losses": losses,
            "local_bytes": trainer.local_parameter_bytes(),
            "counts": counts,
            "buckets": [list(b) for b in layout.buckets],
            "local_rows": {f: s.local_rows for f, s in layout.sharded.items()},
            "replicated": list(layout.replicated),
        }
        state = trainer.full_state_dict()
        np.savez(out / f"rank{rank}_{case}.npz", **state)
        (out / f"rank{rank}_{case}.json").write_text(json.dumps(info))


if __name__ == "__main__":
    worker_main(body)
