"""One module per trainer (:class:`dpml.train.protocol.Trainer` subclasses); listed in :mod:`dpml.train.registry`."""
