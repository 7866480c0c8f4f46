"""DataLoader workers as Ray actors on a cluster (``worker_mode="ray"``): the actor that runs a
worker, the form a batch takes in Ray's object store, and the options that place the actors.
The main process's side is :mod:`fastfeed.backends.ray.backend`. Nothing here imports Ray
until ``worker_mode="ray"`` asks for it."""
