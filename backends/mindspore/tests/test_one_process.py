"""On one worker nothing is split: ShardedTrainer is the plain MindSpore loop, bitwise."""

from __future__ import annotations

import numpy as np
from common import STEPS, adam, load_example, make_inputs, network, reference
from mindspore import Tensor, nn

from gm_config import PassConfig
from gm_mindspore import ShardedTrainer


def test_one_worker_is_the_plain_loop(tmp_path) -> None:
    example = load_example()
    data = make_inputs(example, tmp_path / "inputs.npz")
    ref_losses, ref_state = reference(example, data)
    trainer = ShardedTrainer(network(example, data), nn.MSELoss(), adam, PassConfig())
    losses = [trainer.train_step(Tensor(x), Tensor(y)) for x, y in zip(data["x"], data["y"])]
    assert losses == ref_losses and len(losses) == STEPS
    state = trainer.full_state_dict()
    for name, want in ref_state.items():
        np.testing.assert_array_equal(state[name], want, err_msg=name)
    assert trainer.local_parameter_bytes() == sum(a.nbytes for a in ref_state.values())
    assert trainer.collective_counts == {}
