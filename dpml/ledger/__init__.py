"""The privacy ledger: what each person's records have spent, across runs, in SQLite or PostgreSQL.

:mod:`~dpml.ledger.ledger` reserves and settles spends; :mod:`~dpml.ledger.views` reads them back (per person,
per lineage); :mod:`~dpml.ledger.spending` is the one spend lifecycle both front doors use. It prices spends with
:mod:`dpml.accounting` and never the other way round.
"""
