"""The verdict: is training waiting for data, or is the loader not the bottleneck?

A pure function of three measured numbers, so that its rules are tested on numbers:

- **data-bound** when training waits for data at least ``DATA_BOUND`` of each step: a faster
  loader makes training faster, up to the model's own pace;
- **compute-bound** when it waits too little for any loader to give it back a gain (under
  ``COMPUTE_BOUND_STALL``: all of it, removed, shortens a step by less than ``MIN_SPEEDUP``)
  *and* the loader alone delivers at least ``HEADROOM`` times what training consumes: the
  loader is not the bottleneck;
- **balanced** otherwise: training waits a little, either because the loader just keeps up
  (a faster model step, with AMP, a bigger GPU or ``torch.compile``, would make training wait
  for data) or, where the loader alone has room to spare, for what training shares with it
  (the CPU cores, the main process's work per batch); the evidence says which.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["BALANCED", "COMPUTE_BOUND", "DATA_BOUND", "MIN_SPEEDUP", "Verdict", "judge"]

DATA_BOUND = "data-bound"
COMPUTE_BOUND = "compute-bound"
BALANCED = "balanced"

# A loader-alone gain under 10 % is within what a busy machine's noise gives between repeats.
MIN_SPEEDUP = 1.10
# Shares of each step spent waiting. The most a loader can give training back is all of its
# wait, a speed-up of 1 / (1 - stall): under 1 - 1 / MIN_SPEEDUP (9.1 %), no loader change can
# count as a gain. (A fixed few per cent is also what a loop that never waits for its loader
# measures on a shared VM: after each step its cores come back cold, and taking a ready batch
# costs milliseconds.) From 15 % on, removing the wait is worth a change of loader.
DATA_BOUND_STALL = 0.15
COMPUTE_BOUND_STALL = 1 - 1 / MIN_SPEEDUP
# How much faster than training the loader alone must be to call it not the bottleneck: with
# less room, the model and the workers compete for the same cores during training.
HEADROOM = 1.5


@dataclass(frozen=True)
class Verdict:
    """``name`` is one of :data:`DATA_BOUND`, :data:`COMPUTE_BOUND`, :data:`BALANCED`;
    ``evidence`` says why, in sentences a newcomer can read."""

    name: str
    evidence: tuple[str, ...]

    @property
    def loader_helps(self) -> bool:
        """Whether a faster loader can speed training up (else the doctor sells nothing)."""
        return self.name != COMPUTE_BOUND


def judge(stall: float, consumer: float, ceiling: float | None) -> Verdict:
    """Decide from the stall (share of each step spent waiting, in [0, 1]), the samples/s
    training consumed, and the samples/s the loader alone delivers (``None``: not measured
    yet, which calls a low stall compute-bound)."""
    waited = f"training waited for data {100 * stall:.0f}% of each step"
    room = ceiling / consumer if ceiling is not None and consumer > 0 else None
    alone = ([] if room is None else
             [f"the loader alone delivers {ceiling:,.0f} samples/s, {room:.1f}× the "
              f"{consumer:,.0f} samples/s training consumed"])
    # With room to spare, what training waits for is not the loader's pace but what the two
    # share: the CPU cores, and the main process's own work per batch.
    shared = ("so the loader keeps pace on its own: training waits for what it shares with "
              "the loader (CPU cores, the main process's work per batch)")
    spare = room is None or room >= HEADROOM
    if stall >= DATA_BOUND_STALL:
        return Verdict(DATA_BOUND, (waited, *alone, *([shared] if room is not None and spare
                                                      else [])))
    if stall < COMPUTE_BOUND_STALL and spare:
        most = 1 / (1 - stall)
        return Verdict(COMPUTE_BOUND, (waited, *alone,
                                       f"a faster loader would not make this training faster: "
                                       f"with no wait at all, steps would be at most "
                                       f"{most:.2f}× faster; the time is in the model step"))
    reason = (shared if spare else "the loader just keeps up: a faster model step would make "
              "training wait for data")
    return Verdict(BALANCED, (waited, *alone, reason))
