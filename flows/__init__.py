"""Prefect flows: composition of the tasks in ``tasks/``, nothing else."""

import os

# A 2-core machine can need more than Prefect's default 20 s to start the ephemeral API (its
# first start migrates a fresh database); the server must not phone home from a closed network.
os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "180")
os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
