"""Executors start a worker process for a job on a device, report its exit, and kill it."""
