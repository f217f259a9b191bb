"""Everything MLflow, and the only package of dpml that imports it (``tests/test_imports.py`` checks).

Its modules load MLflow only when imported, so a stage that records nothing never pays for it:
:mod:`~dpml.tracking.store` (creating and opening the tracking and registry stores),
:mod:`~dpml.tracking.runs` (a release's run and version, and cleaning up after a killed one),
:mod:`~dpml.tracking.serving` (the registered raw-record model), :mod:`~dpml.tracking.registered` (reading a
release back), :mod:`~dpml.tracking.library_runs` (``dpml.train_private``'s run),
:mod:`~dpml.tracking.review_view` and :mod:`~dpml.tracking.dataset`.
"""
