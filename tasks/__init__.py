"""Thin Prefect tasks over :mod:`dpml.stages`: no logic here, only retries and logging."""
