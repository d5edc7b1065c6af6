"""The random-number streams of a rank's pipeline stages: one per stage.

torch draws dropout masks from its default generators (the CPU's and the device's). A rank that
runs one stage leaves that stage's stream in them. A rank that runs two or more (interleaved and
V schedules) keeps the stream of its first stage there and the others' states here, and swaps a
stage's state in around each of its halves: every stage then draws the masks it would draw on a
rank of its own, whichever schedule interleaves it with others. The states kept here are saved
with a checkpoint and restored after an inspection, beside the default generators'.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator, Mapping
from contextlib import contextmanager

import torch


def pipeline_seed(seed: int, stage: int, dp_rank: int) -> int:
    """The seed of pipeline stage ``stage`` on data-parallel index ``dp_rank`` for the user's
    ``seed``: the same in every run with that seed, distinct across stages and replicas (so
    are their dropout masks), shared by the tensor-parallel ranks of one stage, which must draw
    the same masks, and unrelated to ``seed`` itself, so that no stage draws its masks from the
    numbers that initialised the weights."""
    digest = hashlib.sha256(f"gm-pipeline/{seed}/{stage}/{dp_rank}".encode()).digest()
    return int.from_bytes(digest[:8], "big") >> 1  # 63 bits: every generator takes them


class StageGenerators:
    """The streams of this rank's stages (module docstring); the first stage's lives in torch's
    default generators, the others' states here."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.home: int | None = None
        """The stage whose stream the default generators hold."""
        self.states: dict[int, dict[str, torch.Tensor]] = {}
        """Every other stage -> its generators' states (``"cpu"``, and the device's)."""

    def seed(self, seed: int, stages: tuple[int, ...], dp_rank: int) -> int:
        """Seed each of ``stages`` with :func:`pipeline_seed`; returns the first one's seed,
        which the default generators now hold."""
        self.home, self.states = stages[0], {}
        for stage in stages[1:]:
            torch.manual_seed(pipeline_seed(seed, stage, dp_rank))
            self.states[stage] = self._current()
        first = pipeline_seed(seed, stages[0], dp_rank)
        torch.manual_seed(first)
        return first

    @contextmanager
    def drawing(self, stage: int) -> Iterator[None]:
        """A block in which the default generators draw ``stage``'s stream."""
        if stage not in self.states:  # the home stage (or no pipeline): nothing to swap
            yield
            return
        home = self._current()
        self._set(self.states[stage])
        try:
            yield
        finally:
            self.states[stage] = self._current()
            self._set(home)

    def state_dict(self) -> dict[str, torch.Tensor]:
        """Copies of the kept states, ``"stage<s>/<kind>"`` -> state."""
        return {
            f"stage{stage}/{kind}": state.clone()
            for stage, states in self.states.items()
            for kind, state in states.items()
        }

    def load_state_dict(self, saved: Mapping[str, torch.Tensor]) -> None:
        """Take the states :meth:`state_dict` gave; a stage missing from ``saved`` keeps its
        own (a checkpoint of another layout)."""
        for stage, states in self.states.items():
            for kind in states:
                key = f"stage{stage}/{kind}"
                if key in saved:
                    states[kind] = saved[key].clone()

    def _current(self) -> dict[str, torch.Tensor]:
        states = {"cpu": torch.get_rng_state()}
        module = getattr(torch, self.device.type, None)
        if self.device.type != "cpu" and hasattr(module, "get_rng_state"):
            states[self.device.type] = module.get_rng_state(self.device)
        return states

    def _set(self, states: Mapping[str, torch.Tensor]) -> None:
        torch.set_rng_state(states["cpu"])
        if self.device.type != "cpu" and self.device.type in states:
            getattr(torch, self.device.type).set_rng_state(states[self.device.type], self.device)
