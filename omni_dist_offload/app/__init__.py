"""The user-facing front-ends: ``Omni`` (:mod:`.api`), the ``omni-offload`` command (:mod:`.cli`),
data-parallel generation under torchrun (:mod:`.dp`), output files (:mod:`.outputs`) and the
HTTP service (:mod:`.serve`)."""
