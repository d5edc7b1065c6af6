"""Context parallelism: held activations and step time at cp 2 against cp 1, same sequence.

Run: ``python bench/cp_bench.py [--seq 256 1024] [--rows 2] [--steps 5]``.

Two gloo ranks (one thread each), the zoo's tiny HF Llama (2 layers, hidden 32, GQA 4/2
heads, ``sdpa`` attention) on causal batches of ``--rows`` rows. For each global sequence
length, cp 1 (each rank computes the whole sequence, as one process) and cp 2 (each rank
holds half of it) run the same batch, in turn, so machine noise hits them alike. FSDP is off
in both, so the held bytes are activations only.

Held activations, measured: the joint graph is run by an ``fx.Interpreter`` on the real
tensors; when the first backward node is reached, the distinct storages of the forward
values a backward node still reads are summed (the values a graph keeps from forward for
backward: the counterpart of ``pipeline_bench.py``'s bytes kept between a micro-batch's
forward and backward). The step time is the median of ``--steps`` graph calls (forward,
backward and the cp collectives; no optimizer), the first one left out. The collectives are
those the graph issues per step (all-gathers, reduce-scatters, all-reduces).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.fx as fx

from gm_config import PassConfig, Role
from gm_trace import ParallelGroups
from gm_trace.graph import node_meta
from gm_trace.graph.graph_build import collective_kind
from gm_trace.runtime.run_graph import graph_args, run_traced_graph
from gm_trace.testing.compile import compile_joint
from gm_trace.testing.distributed import DistributedPool


def zoo_llama(seq: int) -> torch.nn.Module:
    """The model zoo's tiny HF Llama (sdpa attention) with positions up to ``seq``, seed 0."""
    import transformers

    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=61,
        hidden_size=32,
        num_hidden_layers=2,
        intermediate_size=48,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=seq,
    )
    return transformers.LlamaForCausalLM(config)


def _loss(model, input, label):
    return model(**input, labels=label).loss


class _HeldAtBackward(fx.Interpreter):
    """Runs the graph; ``held`` = bytes of the distinct storages of forward values that a
    backward node reads, when the first backward node runs."""

    held: int | None = None

    def run_node(self, n: fx.Node):
        if self.held is None and n.meta.get(node_meta.PHASE) == "backward":
            storages: dict[int, int] = {}
            for node, value in self.env.items():
                if node.op == "placeholder" or not isinstance(value, torch.Tensor):
                    continue
                if any(u.meta.get(node_meta.PHASE) == "backward" for u in node.users):
                    storage = value.untyped_storage()
                    storages[storage.data_ptr()] = storage.nbytes()
            self.held = sum(storages.values())
        return super().run_node(n)


def _rank(rank: int, world: int, seqs: list[int], rows: int, steps: int) -> dict:
    out = {}
    for seq in seqs:
        ids = torch.randint(0, 61, (rows, seq), generator=torch.Generator().manual_seed(seq))
        batch = ({"input_ids": ids}, ids.clone())
        runs = {}
        for cp in (1, 2):
            model = zoo_llama(seq)
            config = PassConfig(cp_degree=cp, fsdp_enabled=False, enable_overlap=False)
            world = torch.distributed.group.WORLD
            groups = ParallelGroups({Role.CP: world}) if cp > 1 else ParallelGroups()
            joint, _ = compile_joint(model, _loss, batch, config, groups=groups)
            interpreter = _HeldAtBackward(joint.graph_module)
            with torch.no_grad():
                interpreter.run(*graph_args(joint, model, *batch))
            kinds = [collective_kind(n) for n in joint.graph_module.graph.nodes]
            collectives = sum(k is not None for k in kinds)
            runs[cp] = {"joint": joint, "model": model, "held": interpreter.held, "ms": []}
            runs[cp]["collectives"] = collectives
        for step in range(steps + 1):  # alternate: the same noise for both
            for run in runs.values():
                torch.distributed.barrier()
                started = time.perf_counter()
                run_traced_graph(run["joint"], run["model"], *batch)
                if step:
                    run["ms"].append((time.perf_counter() - started) * 1e3)
        out[seq] = {
            cp: {
                "held": run["held"],
                "step_ms": statistics.median(run["ms"]),
                "collectives": run["collectives"],
            }
            for cp, run in runs.items()
        }
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq", type=int, nargs="+", default=[256, 1024])
    parser.add_argument("--rows", type=int, default=2)
    parser.add_argument("--steps", type=int, default=5)
    args = parser.parse_args()
    with DistributedPool(2) as pool:
        results = pool.run(_rank, args.seq, args.rows, args.steps, timeout=1800)
    print(f"HF Llama (tiny), {args.rows} rows, causal, 2 gloo ranks, FSDP off\n")
    print(
        "| seq | rank | cp | held activations, measured | step ms | held vs cp 1 | step vs cp 1 "
        "| collectives per step |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for seq in args.seq:
        for rank, result in enumerate(results):
            one = result[seq][1]
            for cp in (1, 2):
                r = result[seq][cp]
                print(
                    f"| {seq} | {rank} | {cp} | {r['held'] / 2**20:.2f} MiB | "
                    f"{r['step_ms']:.1f} | {r['held'] / one['held']:.2f}x | "
                    f"{r['step_ms'] / one['step_ms']:.2f}x | {r['collectives']} |"
                )


if __name__ == "__main__":
    main()
