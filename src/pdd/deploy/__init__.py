"""Deployment files, topology, and `pdd up` / `pdd down`."""
