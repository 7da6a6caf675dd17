"""Memory: analysis of a lowered step (liveness on fake tensors); scheduling and
rematerialization passes land here."""
