"""The job's held-out evaluation (``train.eval_interval``) runs on the trainer's forward-only
graph of its layout and gives the figure the eager whole copy gave: the mean loss over every
held-out window, each counted once, on 1 process, 2 FSDP ranks and a 2-stage pipeline."""

from __future__ import annotations

import pytest
import torch
from evaluate_job_bodies import job_evaluation

from gm_trainer.job.run.evaluate import plan_batches


@pytest.mark.parametrize(("count", "rows", "micro"), [(23, 4, 1), (23, 4, 2), (7, 8, 4), (0, 2, 1)])
def test_every_window_is_counted_once_with_equal_real_rows_per_micro_batch(count, rows, micro):
    batches = plan_batches(torch.arange(count), rows, micro)
    counted = []
    for batch in batches:
        assert batch.rows.shape == (rows,) and batch.real.shape == (rows,)
        real = [int(m.sum()) for m in batch.real.chunk(micro)]
        assert len(set(real)) == 1  # a pipeline averages its micro-batches' means
        micro_rows = [
            r[m].tolist() for r, m in zip(batch.rows.chunk(micro), batch.real.chunk(micro))
        ]
        distinct = {w for part in micro_rows for w in part}
        assert batch.windows == len(distinct)
        repeated = len(distinct) < sum(real)
        if repeated:  # the same windows in every micro-batch
            assert all(part == micro_rows[0] for part in micro_rows)
        counted += sorted(distinct)
    assert sorted(counted) == list(range(count))


def _same(result: dict) -> None:
    torch.testing.assert_close(result["graph"], result["eager"], rtol=1e-6, atol=0.0)


def test_evaluation_on_one_process_equals_the_eager_copy():
    _same(job_evaluation(0, 1))


@pytest.mark.distributed
def test_evaluation_on_two_fsdp_ranks_equals_the_eager_copy(dist_pool):
    results = dist_pool(2).run(job_evaluation)
    for result in results:
        _same(result)
    assert results[0]["graph"] == results[1]["graph"]


@pytest.mark.distributed
def test_evaluation_in_a_two_stage_pipeline_equals_the_eager_copy(dist_pool):
    results = dist_pool(2).run(job_evaluation, 2)
    for result in results:
        _same(result)
    assert results[0]["graph"] == results[1]["graph"]
