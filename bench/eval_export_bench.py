"""Peak RSS that held-out evaluation and the export add, per rank, against a job without them.

Run: ``python bench/eval_export_bench.py [--ranks 4] [--dim 1024] [--layers 24] [--heads 16]
[--seq 64] [--cap-mb 256]`` (the defaults are the ~300M GPT; ``--dim 256 --layers 4`` for a
quick look).

Three fresh 4-rank gloo runs of the built-in GPT (built on the meta device, FSDP over the
ranks, one Adam step, a DCP checkpoint), each rank's peak RSS (``ru_maxrss``, the process's
lifetime peak) recorded at the end:

- ``plain``: the step and the checkpoint only;
- ``graph``: then gm-train's evaluation (``job.run.evaluate.Evaluator``: forward-only graphs
  of the FSDP layout) and, on rank 0, both exports streamed from the checkpoint (safetensors
  files of ``--cap-mb`` MB, and ``model.pt`` one tensor at a time);
- ``eager``: then the evaluation as it was done before: every rank gathers the whole model
  (``full_model_state``) into an eager copy.

Printed per rank: peak RSS of each run and the growth over ``plain`` as a ratio to the model's
float32 bytes; the eval losses of ``graph`` and ``eager`` and their relative difference.
"""

from __future__ import annotations

import argparse
import resource
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch

from gm_trace.testing.distributed import DistributedPool

VOCAB = 256


def _peak_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: KiB


def body(rank: int, world: int, mode: str, args: dict[str, Any], folder: str) -> dict[str, Any]:
    from gm_trainer import GraphTrainer
    from gm_trainer.checkpoint import full_model_state, save_checkpoint
    from gm_trainer.checkpoint.stream import ModelReader, save_model_file
    from gm_trainer.job.data.windows import Windows
    from gm_trainer.job.model.builtin import GPT, lm_loss
    from gm_trainer.job.model.export_hf import write_safetensors
    from gm_trainer.job.run.evaluate import Evaluator

    seq, rows = args["seq"], 2
    shape = dict(vocab_size=VOCAB, dim=args["dim"], n_layers=args["layers"])
    shape.update(n_heads=args["heads"], max_seq_len=seq)
    torch.manual_seed(0)
    with torch.device("meta"):
        model = GPT(**shape)
    trainer = GraphTrainer(model, lm_loss, optimizer_config={"lr": 1e-4})
    g = torch.Generator().manual_seed(rank)
    batch = torch.randint(0, VOCAB, (rows, seq + 1), generator=g)
    trainer.train_step(batch[:, :-1], batch[:, 1:])
    trainer.optimizer_step()
    checkpoint = Path(folder) / "step-1"
    save_checkpoint(trainer, checkpoint)
    same = torch.Generator().manual_seed(9)  # the same held-out windows on every rank
    held_out = Windows(torch.randint(0, VOCAB, (8 * world * seq + 1,), generator=same), seq)
    loss, held = None, 0
    if mode == "graph":
        loss = Evaluator(held_out, rows, rank, world)(trainer)["eval_loss"]
        if rank == 0:
            out = Path(folder) / "hf"
            out.mkdir()
            reader = ModelReader(checkpoint)
            held = write_safetensors(reader, list(reader.entries), out, args["cap_mb"] * 2**20)
            held = max(held, save_model_file(checkpoint, Path(folder) / "model.pt"))
    elif mode == "eager":
        whole = GPT(**shape).eval()  # what the job kept before: a whole eager copy
        whole.load_state_dict(full_model_state(trainer))
        total = torch.zeros(2, dtype=torch.float64)
        with torch.no_grad():
            for chunk in torch.arange(rank, held_out.count, world).split(rows):
                w = held_out.get(chunk)
                n = w[:, 1:].numel()
                total += torch.tensor([lm_loss(whole, w[:, :-1], w[:, 1:]).double() * n, n])
        torch.distributed.all_reduce(total)
        loss = float(total[0] / total[1])
        del whole
    peak = _peak_bytes()
    with torch.device("meta"):
        n_bytes = sum(p.numel() for p in GPT(**shape).parameters()) * 4
    return {"peak": peak, "loss": loss, "model_bytes": n_bytes, "held": held}


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--dim", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=24)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--cap-mb", type=int, default=256)
    args = vars(parser.parse_args(argv))
    results = {}
    for mode in ("plain", "graph", "eager"):
        with tempfile.TemporaryDirectory() as folder, DistributedPool(args["ranks"]) as pool:
            results[mode] = pool.run(body, mode, args, folder, timeout=3600.0)
    model_bytes = results["plain"][0]["model_bytes"]
    print(
        f"GPT d={args['dim']} x {args['layers']} blocks: {model_bytes / 4 / 1e6:.1f}M params, "
        f"{model_bytes / 2**30:.2f} GiB float32; {args['ranks']} ranks; export cap "
        f"{args['cap_mb']} MB"
    )
    print("rank | peak plain | graph eval+export (growth / model) | eager copy eval (growth)")
    for rank in range(args["ranks"]):
        plain = results["plain"][rank]["peak"]
        graph, eager = results["graph"][rank]["peak"], results["eager"][rank]["peak"]
        print(
            f"{rank:4d} | {plain / 2**20:8.0f} MB | {graph / 2**20:8.0f} MB "
            f"({(graph - plain) / model_bytes:+.3f}) | {eager / 2**20:8.0f} MB "
            f"({(eager - plain) / model_bytes:+.3f})"
        )
    graph_loss, eager_loss = results["graph"][0]["loss"], results["eager"][0]["loss"]
    print(
        f"eval_loss: graph {graph_loss:.8f}, eager copy {eager_loss:.8f}, rel diff "
        f"{abs(graph_loss - eager_loss) / abs(eager_loss):.2e}; rank 0's export held at most "
        f"{results['graph'][0]['held'] / 2**20:.0f} MB of tensors at once"
    )


if __name__ == "__main__":
    main(sys.argv[1:])
