"""Where workers run: processes (the default; batches cross through the ring), threads, or
Ray actors on a cluster (:mod:`fastfeed.backends.ray`)."""
