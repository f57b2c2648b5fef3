"""What a run has spent and may spend, and whether it samples what the accounting assumes.

- ``ledger``: every private step applied, with the values it ran with, fed to the accountant (and checkpointed);
- ``budget``: how many steps fit ``target_epsilon``, and what a step past it does;
- ``report``: ``PrivacyReport``, what ``engine.privacy_report()`` returns;
- ``loader_checks``: the loader given to ``attach``, checked against the accounting (unit, rate, groups, K);
- ``sampling``: the samples counted at each step, tested against Poisson sampling at the rate accounted for.

Internal, behind the engine. It may import ``accounting``, ``data`` and ``_checks``. The engine's configuration is
read (its noise multiplier, sample rate, sample size, ...), not imported, so that the engine's step (``core.step``)
can import this package.
"""
