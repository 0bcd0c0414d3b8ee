"""The collective wing: process groups and everything ckptools says to the other ranks.

``group.py`` (process-group helpers that also work with no group at all), ``launch.py``
(`init_distributed`), ``arrival.py`` (every rank checks in at a collective call), ``agree.py`` (the
one way a failure on one rank becomes the same error on every rank), ``tree.py`` (a loaded tree
sent from rank 0 to every rank). Collectives run on the main thread only, in the same order on every
rank; layouts and codecs never import this wing.
"""
