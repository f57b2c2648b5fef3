"""One private step's machinery, behind the facade (``dptrain.engine.PrivacyEngine``), which wires it together.

- What the engine is told: ``config`` (every argument of ``PrivacyEngine`` checked once, the noise calibrated),
  ``algorithms`` (the seven clipping modes as recipes over the operation modules), ``clipping`` (clipping functions
  and groups), ``planning`` and ``plan_report`` (the per-layer choice of ghost norm or instantiation; ``plan()``),
  ``trainable`` (the trainable set, read again at every model call), ``attached`` (one engine per model, foreign
  optimizers refused).
- The forward, what each layer call keeps: ``capture`` and ``layer_hooks`` (the hooks), ``calls`` (a layer call as
  recorded), ``graph_nodes`` (what the engine puts into the autograd graph), ``broadcast``, ``deferred``,
  ``hooks_aside``, ``state_writes``.
- The backward, the per-sample norms and the clipped sums: ``runner`` (which backward runs, how each starts and ends,
  ``refusals``), ``backward`` (one backward and all it owns), ``pipeline`` (its stateless stages, the step's sums),
  ``precision`` (fp16 with a GradScaler).
- The step: ``step`` (the private gradient and the step's lifecycle), ``noise`` (Gaussian noise), ``distributed``
  (DDP and FSDP2).

Internal: ``dptrain`` re-exports its public names (``plan``, ``CLIPPING_MODES``, ``RECIPES``, ...). It may import
``rows``, ``layers``, ``privacy``, ``correlated``, ``accounting``, ``losses`` and ``_checks``; never the engine nor
what is built on it (``testing``, ``integrations``, ``audit``, ``cli``). This file imports nothing: the command
line reads ``algorithms`` and ``planning``'s tables without loading torch.
"""
