"""``fastfeed doctor``: runs a training script, finds its DataLoader, and says whether training
waits for data, where each sample's time goes, and which of fastfeed's lines would help,
each measured on the script's own data (docs/doctor.md).

The parts, one job each: :mod:`~fastfeed.doctor.probe` (times the script's batches),
:mod:`~fastfeed.doctor.gpu_waits` (sync-aware waits on CUDA), :mod:`~fastfeed.doctor.system`
(CPU and memory), :mod:`~fastfeed.doctor.stages` (per-sample stages),
:mod:`~fastfeed.doctor.loaders` (rebuilding the script's loader),
:mod:`~fastfeed.doctor.candidates` and :mod:`~fastfeed.doctor.trials` (what to offer, measured
loader-alone), :mod:`~fastfeed.doctor.fingerprint` (same batches?),
:mod:`~fastfeed.doctor.verdict`, :mod:`~fastfeed.doctor.measure` (the diagnosis),
:mod:`~fastfeed.doctor.child` (the process that runs the script), and
:mod:`~fastfeed.doctor.cli`, :mod:`~fastfeed.doctor.report`, :mod:`~fastfeed.doctor.plots`
(what the user sees).
"""

from fastfeed.doctor.cli import add_arguments, run

__all__ = ["add_arguments", "run"]
