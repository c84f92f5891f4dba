"""The plan of a layer sequence for one input type, before any variable is placed.

Unit shapes and costs and the cut into chunks (:mod:`.plan`, :mod:`.unit_cost`,
:mod:`.tick_costs`), remat policies (:mod:`.remat`), how each backward action runs
(:mod:`.backward_plan`), auxiliary losses and metrics carried with the activations
(:mod:`.aux_losses`) and running statistics pooled over a step (:mod:`.statistics`). Imports
:mod:`tpipe.core.base` only.
"""
