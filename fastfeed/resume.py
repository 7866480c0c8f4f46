"""Resumable loading: what a mid-epoch snapshot holds, and how an epoch restarts from one.

An epoch is reproducible from the random state at its start plus the number of batches
already delivered: restoring the state makes the sampler draw the same permutation and the
iterator the same worker base seed, and the delivered index batches are then skipped without
loading them. IterableDatasets cannot skip by index; they resume from their own
``state_dict()`` (one per worker replica) when it follows the protocol of
:func:`has_snapshot_protocol`, or else by reading and discarding the delivered batches.
"""

from __future__ import annotations

import inspect
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

__all__ = ["EpochStart", "LoaderState", "RandomSources", "has_snapshot_protocol"]

STATE_VERSION = 1


def has_snapshot_protocol(dataset: Any) -> bool:
    """Whether fastfeed may snapshot ``dataset`` with its own ``state_dict()``.

    Only the protocol of torchdata's ``StatefulDataLoader`` (and Hugging Face datasets):
    ``state_dict()`` callable with no arguments, and ``load_state_dict(state)``. Streaming
    libraries (litdata, mosaicml-streaming) give their datasets a ``state_dict`` with
    arguments that belongs to their own loaders, and some refuse it inside workers: those
    resume by re-reading, as plain datasets do.
    """
    state_dict = getattr(dataset, "state_dict", None)
    if not callable(state_dict) or not callable(getattr(dataset, "load_state_dict", None)):
        return False
    try:
        parameters = inspect.signature(state_dict).parameters.values()
    except (TypeError, ValueError):
        return False
    required = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD,
                inspect.Parameter.KEYWORD_ONLY)
    return not any(p.kind in required and p.default is p.empty for p in parameters)


@dataclass(frozen=True)
class RandomSources:
    """Where a loader's epoch draws from: its ``generator`` (else torch's global RNG), and a
    sampler's own generator (``RandomSampler(generator=...)``), which the loader's does not
    cover."""

    generator: torch.Generator | None
    sampler_generator: torch.Generator | None

    @classmethod
    def of(cls, loader: Any) -> RandomSources:
        sampler = loader.sampler
        if loader.batch_sampler is not None:  # a user's batch sampler may wrap no sampler
            sampler = getattr(loader.batch_sampler, "sampler", loader.batch_sampler)
        own = getattr(sampler, "generator", None)
        if not isinstance(own, torch.Generator) or own is loader.generator:
            own = None
        return cls(loader.generator, own)


@dataclass
class EpochStart:
    """The random state an epoch starts from: the loader's generator, or torch's global RNG,
    and a sampler's own generator."""

    generator_state: torch.Tensor | None = None
    global_rng_state: torch.Tensor | None = None
    sampler_generator_state: torch.Tensor | None = None

    @classmethod
    def capture(cls, sources: RandomSources) -> EpochStart:
        own = sources.sampler_generator
        state = cls(sampler_generator_state=own.get_state() if own is not None else None)
        if sources.generator is not None:
            state.generator_state = sources.generator.get_state()
        else:
            state.global_rng_state = torch.get_rng_state()
        return state

    def restore(self, sources: RandomSources) -> None:
        generator, own = sources.generator, sources.sampler_generator
        if (own is None) != (self.sampler_generator_state is None):
            raise _built_otherwise("a sampler generator", self.sampler_generator_state)
        if generator is not None and self.generator_state is not None:
            generator.set_state(self.generator_state)
        elif generator is None and self.global_rng_state is not None:
            torch.set_rng_state(self.global_rng_state)
        else:
            raise _built_otherwise("a generator", self.generator_state)
        if own is not None and self.sampler_generator_state is not None:
            own.set_state(self.sampler_generator_state)


def _built_otherwise(what: str, saved: torch.Tensor | None) -> ValueError:
    """The error for a state saved from a loader with (or without) ``what``, loaded into one
    without (or with) it."""
    return ValueError(f"this state was saved from a loader {'without' if saved is None else 'with'}"
                      f" {what}; load it into a loader built the same way")


@dataclass
class LoaderState:
    """A FastLoader snapshot: small, picklable, and (for map-style data) worker-count free.

    Attributes:
        batches_yielded: batches of the current epoch already delivered.
        epoch_start: the random state the current epoch started from.
        dataset_states: IterableDataset ``state_dict()`` after the last delivered batch, one
            per worker replica (one for ``num_workers=0``); None when the dataset has none.
        next_worker: the replica whose batch comes next (round-robin position).
        workers_done: replicas already exhausted before the next batch.
        draws_base_seed: whether the epoch drew its workers' base seed from the random state
            (after creating the sampler's iterator, as torch does): an iterator's first epoch
            does, the later epochs of persistent workers do not.
        base_seed: the workers' base seed, for an epoch that does not draw one.
    """

    batches_yielded: int = 0
    epoch_start: EpochStart = field(default_factory=EpochStart)
    dataset_states: list[Any] | None = None
    next_worker: int = 0
    workers_done: list[bool] | None = None
    draws_base_seed: bool = True
    base_seed: int | None = None

    def replica_state(self, worker_id: int, num_workers: int) -> Any:
        """The IterableDataset state replica ``worker_id`` resumes from (None: none saved).

        Raises:
            ValueError: the state holds another number of replicas than ``num_workers``.
        """
        if self.dataset_states is None:
            return None
        if len(self.dataset_states) != num_workers:
            raise ValueError(
                f"the loader state holds {len(self.dataset_states)} IterableDataset replica "
                f"states but this loader has {num_workers} workers; resume with the same "
                "num_workers"
            )
        return self.dataset_states[worker_id]

    def to_dict(self) -> dict[str, Any]:
        return {"version": STATE_VERSION, **asdict(self)}

    @classmethod
    def from_dict(cls, state: dict[str, Any]) -> LoaderState:
        if not isinstance(state, dict) or state.get("version") != STATE_VERSION:
            raise ValueError(
                f"not a fastfeed loader state (version {STATE_VERSION}): "
                f"got {type(state).__name__} with version "
                f"{state.get('version') if isinstance(state, dict) else None!r}"
            )
        fields = {k: v for k, v in state.items() if k != "version"}
        fields["epoch_start"] = EpochStart(**fields.get("epoch_start", {}))
        return cls(**fields)
