"""Which measured options to recommend: a pure function of the measured numbers, so that its
rule is tested on numbers.

An option is recommended from a loader-alone speed-up of :data:`~fastfeed.doctor.verdict.
MIN_SPEEDUP`. An option that does work of its own on the GPU (decoding, augmenting) is measured
loader-alone, on a GPU with nothing else to do; in training that work shares the GPU with the
model's step. Its GPU time per sample, measured in its runs, is then added to the model's step
("with its data for free"), and the option is recommended only if training could still gain
:data:`MIN_SPEEDUP` over what it consumed: a faster loader that slows the model more than it
feeds it is no gain.
"""

from __future__ import annotations

from dataclasses import replace

from fastfeed.doctor.findings import Option
from fastfeed.doctor.verdict import MIN_SPEEDUP

__all__ = ["recommend", "training_bound"]


def training_bound(option_rate: float, model_rate: float, gpu_s_per_sample: float) -> float:
    """The most samples/s training can take with an option: its loader-alone rate, or the
    model step lengthened by the option's GPU time, whichever is lower."""
    return min(option_rate, 1 / (1 / model_rate + gpu_s_per_sample))


def _with_gpu_share(option: Option, consumer: float, model: float | None) -> Option:
    """``option`` with its bound on training's speed-up and a note on its GPU time."""
    if option.gpu_ms_per_sample is None or not model or consumer <= 0:
        return replace(option, note="; ".join(filter(None, [
            option.note, "its GPU time was not measured (no NVML reading)"])))
    bound = training_bound(option.samples_per_s, model, option.gpu_ms_per_sample / 1000)
    share = (f"{option.gpu_ms_per_sample:.2f} ms of GPU time per sample, added to the model "
             f"step: training at most {bound / consumer:.2f}× faster")
    return replace(option, training_speedup=bound / consumer,
                   note="; ".join(filter(None, [option.note, share])))


def recommend(options: list[Option], consumer: float, model: float | None
              ) -> tuple[list[Option], list[Option]]:
    """The options as measured (those with GPU work given their bound and its note), and the
    recommended ones, best first.

    Args:
        options: the configurations measured, the script's loader (no ``change``) included.
        consumer: samples/s training consumed in the window.
        model: samples/s of the model step alone, with its data for free (``None``: unknown).
    """
    measured = [_with_gpu_share(o, consumer, model) if o.gpu_work else o for o in options]
    chosen = [o for o in measured if o.change and o.speedup >= MIN_SPEEDUP
              and not gpu_cost_outweighs(o)]
    return measured, sorted(chosen, key=lambda o: o.speedup, reverse=True)


def gpu_cost_outweighs(option: Option) -> bool:
    """Whether the loader alone gains, but the GPU time the option's own work takes from the
    model step leaves training without the gain."""
    return (option.speedup >= MIN_SPEEDUP and option.training_speedup is not None
            and option.training_speedup < MIN_SPEEDUP)
