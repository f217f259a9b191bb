"""Privacy accounting: what a trainer releases (:mod:`~dpml.accounting.mechanism`) and what it costs.

Accountants (:mod:`~dpml.accounting.accountants`) turn a mechanism description into a certified (ε, δ), cross-checked
by independent libraries; closed forms, PRV, zCDP, μ-GDP and the KL bound of noisy GD live beside them. Nothing
here keeps state: the ledger (:mod:`dpml.ledger`) composes these prices across runs.
"""
