"""Context parallelism: the ``cp`` pass (:mod:`.cp_pass`) splits the sequence of every
activation over the cp group. The rewriter (:mod:`.rewrite`) copies the graph op by op with
each value's placement; the op rules (:mod:`.rules`, :mod:`.views`, :mod:`.attention`,
:mod:`.other_groups`) decide each op's; :mod:`.layout` owns where the tokens sit and the
collectives that move a value between placements."""

from gm_trace.parallel.cp.cp_pass import (
    ContextParallelError,
    ContextParallelPass,
    cp_leaf_dims,
    describe,
)

__all__ = ["ContextParallelError", "ContextParallelPass", "cp_leaf_dims", "describe"]
