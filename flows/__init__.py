"""Prefect flows: composition of the tasks in ``tasks/``, nothing else."""
