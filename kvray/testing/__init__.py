"""Test support that ships with kvray (as Ray ships ``ray.cluster_utils``)."""
