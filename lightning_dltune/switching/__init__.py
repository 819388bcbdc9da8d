"""Loader switching: rebuilding and switching the train loader (``loader``, ``switch``), seamless epochs
(``seamless``), the evaluation loaders (``evaluation``), and every private Lightning and PyTorch attribute
(``_lightning``)."""
