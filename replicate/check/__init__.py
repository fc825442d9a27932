"""Checking a rewrite by running it: the numeric certificate, single-device comparison, synthetic inputs."""
