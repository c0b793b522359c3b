"""Executable reference models of the claim strategies: the spec as code.

One module per strategy (:mod:`models.lease`, :mod:`models.stream_id`, :mod:`models.idmp`,
:mod:`models.script`) states, as pure functions over frozen values, what the strategy's store does with each
operation and what it answers. They are checked two ways: :mod:`models.explore` enumerates every interleaving
of a few instances in a small scope and checks the properties P1–P6 on every reachable state, and the tests in
``tests/models`` feed a model and a real store the same operations and compare the answers.
"""
