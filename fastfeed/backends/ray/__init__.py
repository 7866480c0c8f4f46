"""DataLoader workers as Ray actors on a cluster (``worker_mode="ray"``), in one package:

* main process: :mod:`~fastfeed.backends.ray.backend` (the backend: ordered waiting on the
  actors' replies, losses), :mod:`~fastfeed.backends.ray.remote` (one worker: its actor, its
  unanswered calls, its replacement), :mod:`~fastfeed.backends.ray.landing` (a batch from the
  object store into its pool slot);
* the actor: :mod:`~fastfeed.backends.ray.actor`;
* both: :mod:`~fastfeed.backends.ray.wire` (a batch in the object store) and
  :mod:`~fastfeed.backends.ray.cluster` (Ray itself, and where the actors go).

Nothing here imports Ray until ``worker_mode="ray"`` asks for it."""
