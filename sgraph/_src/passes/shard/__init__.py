"""Sharding: the collectives of a step traced over DTensors (elision, bucketing,
overlap) and its communication cost."""
