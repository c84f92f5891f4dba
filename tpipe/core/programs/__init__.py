"""The chunk programs the tick loops run, one per signature.

A chunk's forward and backward (:mod:`.chunks`), which chunks share a program
(:mod:`.signatures`), the ring that carries activations between chunks (:mod:`.ring`), weights
gathered one unit at a time over ``fsdp`` (:mod:`.fsdp`) and which of them a unit only casts
(:mod:`.weight_casts`), the split backward of any layer from its jaxpr (:mod:`.taps`), the VJP
residuals kept from a forward (:mod:`.residuals`) and a backward one unit at a time
(:mod:`.unit_backward`). Imports the layers below: layout, planning, base.
"""
