"""Prefect flows: composition of the tasks in ``tasks/``, and the edge of a Prefect run (which API it talks
to: ``flows/prefect_api.py``; its cancellation: ``flows/cancellation.py``). Importing this package
changes no process-global state."""
